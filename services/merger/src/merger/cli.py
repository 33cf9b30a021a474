"""`lorastack merge ...`: merge + verify + publish, and the adapter-only vLLM check.

    lorastack merge ADAPTER[:VERSION] [--dtype float32|bfloat16|float16] [--device auto|cuda|cpu]
                    [--name NAME] [--probes N] [--check]
    lorastack merge check-adapter ADAPTER[:VERSION] [--max-lora-rank 16] [--export DIR]

Heavy imports (torch, transformers, peft) happen inside the handlers. Exit codes: 0 done,
2 bad input, 3 refused (quantized base, digest mismatch, failed verification, not
loadable by vLLM).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from lorastack.errors import ConfigError, Refused, field_errors
from lorastack.serving import VLLM_MAX_LORA_RANKS
from lorastack.subcommands import add_check_flag, add_command
from merger.settings import MergerSettings

CHECK = "check-adapter"


def _fmt(x: float | None) -> str:
    return "n/a (inf/nan)" if x is None else f"{x:.4g}"


def print_report(report: dict[str, Any]) -> None:
    """Print the verification report as a table, then its thresholds."""
    rows = [("merged vs base+adapter (fp32)", report["merged"])]
    if report.get("dtype_only"):
        rows += [
            (f"unmerged {report['dtype']} vs fp32 (dtype alone)", report["dtype_only"]),
            (f"merged vs unmerged {report['dtype']} (merge alone)", report["merge_only"]),
        ]
    print(f"{'comparison':46} {'max|Δlogit|':>12} {'top-1':>8} {'greedy same':>12}")
    for label, r in rows:
        greedy = f"{r['greedy_identical']}/{r['greedy_probes']}"
        print(
            f"{label:46} {_fmt(r['max_abs_logit_diff']):>12} "
            f"{r['top1_agreement']:>8.2%} {greedy:>12}"
        )
    print(f"thresholds ({report['dtype']}): {json.dumps(report['thresholds'])}")
    print(
        f"adapter effect (base vs base+adapter): max|Δlogit| "
        f"{_fmt(report['adapter_effect']['max_abs_logit_diff'])}"
    )


def load_settings() -> MergerSettings:
    """The one settings object, from the environment; a bad value is a ConfigError."""
    from pydantic import ValidationError

    try:
        return MergerSettings()
    except ValidationError as e:
        field, what = field_errors(e)[0]
        raise ConfigError(
            f"merger setting {field}: {what}" if field else f"merger settings: {what}",
            f"fix the environment variable LORASTACK_{field.upper()}",
        ) from None


def cmd_merge(args: argparse.Namespace) -> int:
    """merge an adapter into its base, verify, publish; or check-adapter for vLLM

    lorastack merge ADAPTER[:VERSION] [--dtype D] [--device D] [--name N] [--probes N]
    lorastack merge check-adapter ADAPTER[:VERSION] [--max-lora-rank R] [--export DIR]
    """
    if args.ref == CHECK:
        return cmd_check(args)
    if args.adapter is not None:
        raise ConfigError(f"unexpected argument {args.adapter!r}", "usage: lorastack merge ADAPTER")
    if args.max_lora_rank is not None or args.export is not None:
        raise ConfigError(
            "--max-lora-rank and --export belong to check-adapter",
            "use: lorastack merge check-adapter ADAPTER --max-lora-rank N",
        )
    from merger.merge import merge_adapter

    settings = load_settings()
    if args.check:  # the settings and the refs as a merge takes them; nothing is fetched
        from lorastack.check_mode import run_check
        from lorastack.manifest import parse_ref, validate_name

        parse_ref(args.ref)
        if args.name is not None:
            validate_name(args.name)
        return run_check("merge", settings, adapter=args.ref)
    result = merge_adapter(
        settings,
        args.ref,
        dtype=args.dtype,
        name=args.name,
        probes=8 if args.probes is None else args.probes,
        device=args.device,
    )
    print_report(result.report)
    if result.manifest is None:
        raise Refused(
            f"verification failed ({'; '.join(result.report['failures'])}); nothing was "
            f"published. Report: {result.folder / 'merge-report.json'}",
            " or ".join(result.report["advice"]),
        )
    m = result.manifest
    if result.reused:
        print(
            f"{args.ref} was already merged with these settings: {m.ref} ({m.digest[:19]}), "
            "verified when it was published; nothing to do (--name NEW to merge again)"
        )
    else:
        print(f"published {m.ref} ({m.digest[:19]}) from {result.folder}")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    if args.adapter is None:
        raise ConfigError(
            "check-adapter needs an adapter", "lorastack merge check-adapter RUN/adapter"
        )
    if args.dtype or args.name or args.probes is not None or args.device:
        raise ConfigError(
            "--dtype, --device, --name and --probes belong to a merge", "drop them here"
        )
    from merger.export import check_adapter, export_adapter

    settings = load_settings()
    check = check_adapter(settings, args.adapter, args.max_lora_rank)
    print(
        f"{check.adapter.ref} ({check.architecture}) against vLLM --max-lora-rank "
        f"{check.max_lora_rank}:"
    )
    for f in check.findings:
        print(f"  {f.level}: {f.message}\n    change: {f.hint}")
    if check.errors:
        raise Refused(
            f"{check.adapter.ref} is not loadable by vLLM ({len(check.errors)} problem(s) above)",
            "apply the changes listed, or merge it (lorastack merge) and serve the merged model",
        )
    print("  loadable by vLLM as a LoRA adapter (--enable-lora)")
    if args.export:
        dest = export_adapter(settings, check, Path(args.export))
        print(f"exported to {dest}; serve with --lora-modules NAME={dest}")
    return 0


def register(sub: Any) -> None:
    p = add_command(sub, "merge", cmd_merge, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("ref", metavar="ADAPTER[:VERSION] | check-adapter")
    p.add_argument("adapter", nargs="?", help="with check-adapter: the adapter to check")
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        help="output dtype; default the base's own (bfloat16 for most hub models)",
    )
    p.add_argument(
        "--device",
        choices=("auto", "cuda", "cpu"),
        help="where deltas and verification run; default LORASTACK_MERGE_DEVICE or auto (GPU if any)",
    )
    p.add_argument("--name", help="name of the merged model; default RUN/merged")
    p.add_argument("--probes", type=int, help="validation conversations to verify on; default 8")
    p.add_argument(
        "--max-lora-rank",
        type=int,
        choices=VLLM_MAX_LORA_RANKS,
        help="check-adapter: the server's --max-lora-rank (default LORASTACK_MAX_LORA_RANK or 16)",
    )
    p.add_argument("--export", help="check-adapter: copy the serving files into this folder")
    add_check_flag(p, "check the settings, adapter ref and secrets as a merge would, then stop")
