"""KV-cache capacity: our estimate from the model shape, and vLLM's own figures.

Pure functions over plain data, no I/O except `read_shape` (reads config.json and the
safetensors headers of a model folder). The arithmetic, per token:

    bytes/token = 2 (K and V) × layers × kv_heads × head_dim × bytes per KV element

and the memory budget the cache may use:

    GPU: total × gpu_memory_utilization − weights − overhead (activations, CUDA graphs, …),
    or gpu_kv_cache_gib where the serve config fixes it
    CPU: the configured KV space (VLLM_CPU_KVCACHE_SPACE, GiB)

vLLM allocates whole blocks (`block_size` tokens: 128 on CPU, 16 on GPU), so capacity is
floor(budget / (bytes/token × block_size)) × block_size, and the concurrency it logs is
capacity / max_model_len (requests that could each hold a full context at once).
Example, SmolLM2-135M in fp32 with 1 GiB on CPU: 46,080 bytes/token, 182 blocks of 128,
23,296 tokens, 11.38x at 2,048 tokens.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from lorastack.errors import ConfigError

if TYPE_CHECKING:
    from inference.settings import InferenceSettings

GIB = 1024**3  # bytes

DTYPE_BYTES = {  # bytes per element
    "float32": 4, "fp32": 4, "float": 4,
    "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2,
    "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "int8": 1,
}  # fmt: skip
SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1}
DEFAULT_BLOCK_SIZE = {"cpu": 128, "cuda": 16}  # tokens per KV block in vLLM 0.32
DEFAULT_GPU_OVERHEAD_GIB = 2.0  # activations at the profiling batch + CUDA graphs + non-torch

Platform = Literal["cpu", "cuda"]


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a dtype name; ConfigError for an unknown one."""
    try:
        return DTYPE_BYTES[dtype.lower()]
    except KeyError:
        raise ConfigError(
            f"unknown dtype {dtype!r}", f"use one of {', '.join(sorted(DTYPE_BYTES))}"
        ) from None


@dataclass(frozen=True)
class ModelShape:
    """What the KV cache and the weights' size depend on."""

    layers: int
    kv_heads: int
    head_dim: int
    params: int  # number of weight elements (tied embeddings counted once)
    config_dtype: str = "float32"  # torch_dtype in config.json

    @classmethod
    def from_config(cls, config: dict[str, Any], params: int = 0) -> ModelShape:
        """The shape of the model of a config.json; ConfigError if a needed key is missing."""
        cfg = config.get("text_config", config)  # multimodal configs nest the LM
        try:
            layers = int(cfg["num_hidden_layers"])
            heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
        except KeyError as e:
            raise ConfigError(
                f"model config.json lacks {e.args[0]!r}",
                "point at a Hugging Face causal-LM folder (config.json with num_hidden_layers, "
                "num_attention_heads, hidden_size)",
            ) from None
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32")
        return cls(layers, kv_heads, head_dim, params, dtype)


def bytes_per_token(shape: ModelShape, kv_dtype: str) -> int:
    """KV-cache bytes one token occupies across all layers (K and V)."""
    return 2 * shape.layers * shape.kv_heads * shape.head_dim * dtype_bytes(kv_dtype)


def resolve_dtype(dtype: str, shape: ModelShape, platform: Platform) -> str:
    """The dtype vLLM computes in for `--dtype dtype` ('auto': fp32 checkpoints run in
    bf16 on GPU, and as stored on CPU)."""
    if dtype != "auto":
        return dtype
    stored = shape.config_dtype
    if platform == "cuda" and dtype_bytes(stored) == 4:
        return "bfloat16"
    return stored


@dataclass(frozen=True)
class KvEstimate:
    """The KV-cache capacity estimated from the model shape: bytes per token, blocks, tokens."""

    platform: Platform
    bytes_per_token: int
    budget_bytes: int  # bytes the KV cache may use
    weights_bytes: int  # 0 on CPU (the KV space is configured apart from the weights)
    device_bytes: int  # GPU: total memory; 0 on CPU
    gpu_util: float  # GPU: --gpu-memory-utilization; 0 on CPU
    block_size: int  # tokens per block
    num_blocks: int
    capacity_tokens: int  # num_blocks × block_size
    max_model_len: int  # tokens, prompt + output
    max_concurrency: float  # capacity_tokens / max_model_len
    max_num_seqs: int
    typical_tokens: int  # tokens a typical request holds (prompt + output)
    fits: bool  # max_num_seqs × typical_tokens ≤ capacity_tokens
    warnings: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        """The estimate as a JSON-ready dict."""
        d = asdict(self)
        d["warnings"] = list(self.warnings)
        d["max_concurrency"] = round(self.max_concurrency, 2)
        return d


def capacity_tokens(budget_bytes: int, per_token: int, block_size: int) -> tuple[int, int]:
    """(blocks, tokens) vLLM allocates from `budget_bytes`; it rounds down to whole blocks."""
    blocks = max(0, budget_bytes // (per_token * block_size))
    return blocks, blocks * block_size


# the KvSetup fields a serve setting of the same name gives as it is
_SETTINGS_AS_THEY_ARE = "max_model_len max_num_seqs kv_cache_gib gpu_kv_cache_gib typical_tokens"


@dataclass(frozen=True, kw_only=True)
class KvSetup:
    """What the estimate asks besides the model's shape: the platform, the limits vLLM runs
    with, the dtypes and the memory the cache may take. The supervisor builds it from its
    settings (`from_settings`), `lorastack kv-estimate` from its flags."""

    platform: Platform
    max_model_len: int  # tokens, prompt + output
    max_num_seqs: int
    dtype: str = "auto"
    kv_dtype: str = "auto"
    kv_cache_gib: float = 1.0  # CPU: VLLM_CPU_KVCACHE_SPACE
    gpu_mem_gib: float = 0.0  # GPU: total memory of the device
    gpu_util: float = 0.9  # GPU: --gpu-memory-utilization
    gpu_kv_cache_gib: float = 0.0  # GPU: a fixed KV cache (--kv-cache-memory-bytes); 0: off
    overhead_gib: float = DEFAULT_GPU_OVERHEAD_GIB  # GPU: activations, graphs, non-torch
    block_size: int | None = None  # default: vLLM's for the platform
    typical_tokens: int | None = None  # default: max_model_len

    @classmethod
    def from_settings(
        cls, settings: InferenceSettings, *, platform: Platform, dtype: str, gpu_mem_gib: float
    ) -> KvSetup:
        """The setup the serve settings describe, for vLLM computing in `dtype` on
        `platform` with `gpu_mem_gib` (0 on CPU)."""
        return cls(
            platform=platform,
            dtype=dtype,
            kv_dtype=settings.kv_cache_dtype,
            gpu_mem_gib=gpu_mem_gib,
            gpu_util=settings.gpu_memory_utilization,
            overhead_gib=settings.gpu_overhead_gib,
            **{name: getattr(settings, name) for name in _SETTINGS_AS_THEY_ARE.split()},
        )


def estimate(shape: ModelShape, setup: KvSetup) -> KvEstimate:
    """The KV-cache capacity of a model shape on a platform (CPU KV space or GPU memory)."""
    platform, max_model_len, max_num_seqs = setup.platform, setup.max_model_len, setup.max_num_seqs
    compute_dtype = resolve_dtype(setup.dtype, shape, platform)
    per_token = bytes_per_token(
        shape, compute_dtype if setup.kv_dtype == "auto" else setup.kv_dtype
    )
    block = setup.block_size or DEFAULT_BLOCK_SIZE[platform]
    if platform == "cpu":
        weights = 0
        budget = int(setup.kv_cache_gib * GIB)
    else:
        if setup.gpu_mem_gib <= 0:
            raise ConfigError("GPU memory is unknown", "pass --gpu-mem-gib (e.g. 80 for an H100)")
        weights = shape.params * dtype_bytes(compute_dtype)
        budget = (
            int(setup.gpu_kv_cache_gib * GIB)
            if setup.gpu_kv_cache_gib
            else int(setup.gpu_mem_gib * setup.gpu_util * GIB)
            - weights
            - int(setup.overhead_gib * GIB)
        )
    blocks, tokens = capacity_tokens(max(budget, 0), per_token, block)
    typical = setup.typical_tokens or max_model_len
    concurrency = tokens / max_model_len
    fits = max_num_seqs * typical <= tokens
    warnings = _capacity_warnings(tokens, max_model_len, max_num_seqs, typical)
    return KvEstimate(
        platform=platform,
        bytes_per_token=per_token,
        budget_bytes=max(budget, 0),
        weights_bytes=weights,
        device_bytes=int(setup.gpu_mem_gib * GIB) if platform == "cuda" else 0,
        gpu_util=setup.gpu_util if platform == "cuda" else 0.0,
        block_size=block,
        num_blocks=blocks,
        capacity_tokens=tokens,
        max_model_len=max_model_len,
        max_concurrency=concurrency,
        max_num_seqs=max_num_seqs,
        typical_tokens=typical,
        fits=fits,
        warnings=tuple(warnings),
    )


def _capacity_warnings(
    tokens: int, max_model_len: int, max_num_seqs: int, typical: int
) -> list[str]:
    """What a KV cache of `tokens` means for vLLM: it refuses to start below one request of
    `max_model_len`; it preempts when `max_num_seqs` requests of `typical` tokens do not fit."""
    warnings: list[str] = []
    if tokens < max_model_len:
        warnings.append(
            f"the KV cache holds {tokens:,} tokens, less than one request of max-model-len "
            f"{max_model_len:,}: vLLM refuses to start; lower --max-model-len or give it "
            "more memory"
        )
    if max_num_seqs * typical > tokens >= max_model_len:
        warnings.append(
            f"max-num-seqs {max_num_seqs} × {typical:,} tokens = {max_num_seqs * typical:,} "
            f"tokens > capacity {tokens:,}: under full load vLLM will preempt requests "
            f"(about {tokens // typical} fit at once); lower --max-num-seqs or "
            "--max-model-len, or raise the memory"
        )
    return warnings


def explain_flags(est: KvEstimate, shape: ModelShape, kv_dtype: str = "auto") -> list[str]:
    """One line per flag on what it does to capacity and concurrency."""
    per_gib = GIB // est.bytes_per_token  # tokens per GiB of KV space
    full = est.max_model_len
    lines: list[str] = []
    if est.platform == "cuda":
        step = int(est.device_bytes * 0.01) // est.bytes_per_token  # tokens per +0.01
        lines.append(
            f"--gpu-memory-utilization {est.gpu_util:.2f}: each +0.01 of the "
            f"{est.device_bytes / GIB:.0f} GiB adds about {step:,} tokens "
            f"({step / full:.2f} full requests); the weights ({est.weights_bytes / GIB:.2f} GiB) "
            "and overhead come off the top first"
        )
    else:
        lines.append(
            f"kv_cache_gib (VLLM_CPU_KVCACHE_SPACE): every GiB holds {per_gib:,} tokens "
            f"({per_gib / full:.2f} full requests)"
        )
    lines.append(
        f"--max-model-len {full:,}: leaves capacity alone; {est.max_concurrency:.2f} requests "
        "of that length fit at once, halving it doubles that"
    )
    demand = est.max_num_seqs * est.typical_tokens
    lines.append(
        f"--max-num-seqs {est.max_num_seqs}: leaves capacity alone; caps requests running at "
        f"once ({est.max_num_seqs} x {est.typical_tokens:,} = {demand:,} tokens: "
        + ("fits" if est.fits else "does not fit, expect preemption under load")
        + ")"
    )
    one_byte = 2 * shape.layers * shape.kv_heads * shape.head_dim  # bytes/token at 1 byte
    if kv_dtype == "auto" and est.bytes_per_token > one_byte:
        lines.append(
            f"--kv-cache-dtype fp8 (GPU): {one_byte:,} bytes/token instead of "
            f"{est.bytes_per_token:,}, {est.bytes_per_token // one_byte}x the tokens"
        )
    else:
        lines.append(f"--kv-cache-dtype {kv_dtype}: {est.bytes_per_token:,} bytes/token")
    return lines


# -- reading a model folder ------------------------------------------------------------


def count_safetensors_params(folder: Path) -> int:
    """Elements across every *.safetensors file, from the headers only (no tensor data)."""
    total = 0
    for f in sorted(folder.glob("*.safetensors")):
        with f.open("rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, info in header.items():
            if name == "__metadata__":
                continue
            count = 1
            for dim in info["shape"]:
                count *= int(dim)
            total += count
    return total


def read_shape(folder: Path) -> ModelShape:
    """The model shape of a Hugging Face folder (config.json and the safetensors' parameters)."""
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise ConfigError(
            f"{folder} has no config.json",
            "point at a Hugging Face model folder or a base-model / merged-model artifact",
        )
    config = json.loads(cfg_path.read_text())
    return ModelShape.from_config(config, params=count_safetensors_params(folder))


# -- what vLLM says --------------------------------------------------------------------

_KV_LINE = re.compile(r"\b(CPU|GPU) KV cache size: ([\d,]+) tokens")
_CONCURRENCY = re.compile(r"Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x")


@dataclass(frozen=True)
class VllmKvReport:
    """The KV-cache capacity vLLM logged at start."""

    device: str  # "CPU" or "GPU", as logged
    capacity_tokens: int
    max_model_len: int | None
    max_concurrency: float | None


def parse_kv_log(text: str) -> VllmKvReport | None:
    """vLLM's KV-cache figures from its log (the last report wins after a restart)."""
    found: VllmKvReport | None = None
    for line in text.splitlines():
        m = _KV_LINE.search(line)
        if not m:
            continue
        c = _CONCURRENCY.search(line)
        found = VllmKvReport(
            device=m.group(1),
            capacity_tokens=int(m.group(2).replace(",", "")),
            max_model_len=int(c.group(1).replace(",", "")) if c else None,
            max_concurrency=float(c.group(2)) if c else None,
        )
    return found


def parse_cache_config_info(metrics_text: str) -> dict[str, str] | None:
    """The labels of `vllm:cache_config_info` in a Prometheus text page, or None."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(metrics_text):
        if family.name == "vllm:cache_config_info":
            for sample in family.samples:
                return dict(sample.labels)
    return None


def tokens_from_cache_config(labels: dict[str, str]) -> int | None:
    """Capacity in tokens from cache_config_info labels (kv_cache_size_tokens, or
    num_gpu_blocks × block_size on servers that lack it)."""
    if labels.get("kv_cache_size_tokens", "None").isdigit():
        return int(labels["kv_cache_size_tokens"])
    blocks, block = labels.get("num_gpu_blocks", ""), labels.get("block_size", "")
    if blocks.isdigit() and block.isdigit():
        return int(blocks) * int(block)
    return None


def relative_difference(estimate_tokens: int, reported_tokens: int) -> float:
    """(estimate − reported) / reported, e.g. 0.012 = our estimate is 1.2% high."""
    return (estimate_tokens - reported_tokens) / reported_tokens if reported_tokens else 0.0
