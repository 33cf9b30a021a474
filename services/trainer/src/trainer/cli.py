"""`lorastack data ...` and `lorastack train ...`: argument parsing and printing only.

    lorastack data make-demo OUT.jsonl [--n 200] [--seed 0] [--tools]
    lorastack data inspect CONFIG [--index N] [--split train] [key=value ...]
    lorastack data check CONFIG [--json] [key=value ...]  (exit 0 ok, 1 warnings, 3 refused)
    lorastack train CONFIG [--smoke] [--resume [auto]] [--overfit N] [--auto-batch] [key=value ...]
    lorastack train CONFIG --check  (settings, config, processes, no placeholder; no work)
    lorastack train sweep CONFIG --ranks 4,8,16 [key=value ...]

Settings are built once here and passed down; heavy imports stay inside handlers.
"""

from __future__ import annotations

import argparse
import shlex
import time
from pathlib import Path
from typing import Any

from lorastack.errors import ConfigError
from lorastack.subcommands import add_check_flag, add_command, add_json_flag
from trainer.config import RunConfig, load_config, with_overrides
from trainer.settings import TrainerSettings

CHECK_HELP = "check the settings, config and secrets as a start would, then stop (exit 0: ok)"


def _config(args: argparse.Namespace) -> RunConfig:
    return load_config(Path(args.config), list(args.overrides))


def cmd_make_demo(args: argparse.Namespace) -> int:
    """write the demo task (written date -> ISO date)"""
    from lorastack.chat_data import write_jsonl
    from trainer.data.demo_data import make_demo
    from trainer.data.demo_tools import make_tool_demo

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    convs = (make_tool_demo if args.tools else make_demo)(args.n, args.seed)
    write_jsonl(out, convs)
    first = convs[0].messages
    print(f"wrote {len(convs)} conversations to {out}")
    print(f"  e.g. user: {first[1].content!r} -> assistant: {first[2].flat_text!r}")
    if args.tools:
        print(
            "  train with chat_template: chatml-tools unless the base model's own template "
            "renders tools (SmolLM2's does not)"
        )
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    """check the dataset against the run config (also run before training)"""
    import sys

    from trainer.data.preparation import check

    report = check(_config(args), TrainerSettings(), progress=sys.stderr.isatty())
    print(report.to_json() if args.json else report.render())
    return report.exit_code  # 0: ok; 1: trainable, with warnings; 3: refused (the lines say why)


def cmd_inspect(args: argparse.Namespace) -> int:
    """show one sample as the model sees it, supervised tokens marked"""
    import shutil

    from trainer.data.masking import IGNORE
    from trainer.data.preparation import prepare
    from trainer.data.samples import encode

    config, settings = _config(args), TrainerSettings()
    staging = settings.resolved_runs_dir / config.output / "inspect"
    try:
        prep = prepare(config, settings, staging)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    items = getattr(prep.splits, args.split)
    if not 0 <= args.index < len(items):
        raise ConfigError(
            f"--index {args.index} is out of range: the {args.split} split has {len(items)} samples",
            f"use 0..{len(items) - 1}",
        )
    item = items[args.index]
    sample = encode(item.conv, prep.tokenizer, config.loss_on)
    lengths = sample.parts  # tokens per part of the conversation
    print(
        f"{args.split} sample {args.index} (conversation {item.number} of {prep.splits.source}): "
        f"{sample.length} tokens = system {lengths['system']} + history {lengths['history']} "
        f"+ target {lengths['target']}; "
        f"supervised {sample.supervised} (loss_on={config.loss_on}, max_seq_len={config.max_seq_len})"
    )
    if item.conv.has_tools:
        msgs, template = item.conv.messages, config.chat_template or "the base model's own"
        print(
            f"tools: {', '.join(t.function.name for t in item.conv.tools or [])}; "
            f"{sum(len(m.tool_calls or []) for m in msgs)} call(s) (supervised), "
            f"{sum(m.role == 'tool' for m in msgs)} tool result(s) (context, never supervised); "
            f"template: {template}"
        )
    print("--- rendered context; supervised text between ⟦ and ⟧ ---")
    print(_marked(sample))
    print("--- tokens (+ = supervised, . = masked) ---")
    for i, (tid, lab) in enumerate(zip(sample.input_ids, sample.labels, strict=True)):
        piece = prep.tokenizer.convert_ids_to_tokens(tid)
        print(f"{i:5} {'+' if lab != IGNORE else '.'} {tid:6}  {piece!r}")
    return 0


def _marked(sample: Any) -> str:
    """The sample's rendered text with its supervised spans between ⟦ and ⟧."""
    from trainer.data.masking import IGNORE

    text, in_span = [], False
    for (start, end), label in zip(sample.offsets, sample.labels, strict=True):
        supervised = label != IGNORE
        if supervised and not in_span:
            text.append("⟦")
        if in_span and not supervised:
            text.append("⟧")
        text.append(sample.rendered[start:end])
        in_span = supervised
    return "".join(text) + ("⟧" if in_span else "")


def cmd_train(args: argparse.Namespace) -> int:
    """train a LoRA adapter (or: train sweep CONFIG --ranks 4,8,16)

    lorastack train CONFIG [options] [key=value ...]  |
    lorastack train sweep CONFIG --ranks 4,8,16 [key=value ...]
    """
    if args.config == "sweep":
        return _sweep(args)
    from trainer.recipe import run_training

    if args.ranks:
        raise ConfigError("--ranks belongs to 'lorastack train sweep CONFIG --ranks 4,8,16'", "")
    config, settings = _config(args), TrainerSettings()
    if args.check:
        return _check(config, settings)
    result = run_training(
        config,
        settings,
        smoke=args.smoke,
        resume=_resume(args, config, settings),
        overfit=args.overfit,
        auto_batch=args.auto_batch,
        command=shlex.join(
            ["lorastack", "train", args.config, *args.overrides]
            + (["--auto-batch"] if args.auto_batch else [])
        ),
    )
    c = result.completion
    print(
        f"done: {c['steps']} steps in {c['wall_s']:.1f} s, final train loss "
        f"{c['final_train_loss']}, final val loss {c['final_val_loss']}, cost {c['cost']}"
    )
    if result.adapter is not None:
        print(f"adapter: {result.adapter.ref} {result.adapter.digest[:19]}")
    if result.hook is not None and not result.hook.ok:
        from trainer.errors import HookFailed

        raise HookFailed(
            f"{result.hook.describe()}; the adapter and the run's records stay published and "
            "verified in the store",
            "fix the hook command (it is run with sh -c) and run it by hand, or raise "
            "on_complete.timeout_s",
        )
    return 0


def _check(config: RunConfig, settings: TrainerSettings) -> int:
    """`train --check`: the settings, the config against the processes torchrun starts,
    no placeholder; nothing is fetched or trained."""
    from lorastack.check_mode import run_check
    from trainer.config import check_processes

    check_processes(config, settings.world_size)
    return run_check("train", settings, world_size=settings.world_size, output=config.output)


def _resume(args: argparse.Namespace, config: RunConfig, settings: TrainerSettings) -> bool:
    """`--resume auto` (a Job that restarts): resume when the run has a checkpoint, locally
    or in the store, else start it. The recipe still checks the checkpoint matches."""
    if args.resume != "auto":
        return bool(args.resume)
    from lorastack.store.artifacts import open_store
    from trainer.publish import checkpoint

    root = settings.resolved_runs_dir / config.output / "checkpoints"
    remote = open_store(settings).versions(f"{config.output}/checkpoints")
    return bool(checkpoint.local_steps(root)) or any(v.isdigit() for v in remote)


def _sweep(args: argparse.Namespace) -> int:
    from trainer.model.memory import human
    from trainer.recipe import run_training

    if not args.overrides:
        raise ConfigError(
            "train sweep needs a config file", "lorastack train sweep CONFIG --ranks 4,8,16"
        )
    if not args.ranks:
        raise ConfigError("train sweep needs --ranks", "e.g. --ranks 4,8,16")
    try:
        ranks = [int(r) for r in args.ranks.split(",")]
    except ValueError:
        raise ConfigError(
            f"--ranks {args.ranks!r} is not a list of integers", "e.g. --ranks 4,8,16"
        ) from None
    base = load_config(Path(args.overrides[0]), list(args.overrides[1:]))
    settings = TrainerSettings()
    rows = []
    for r in ranks:
        cfg = with_overrides(
            base, [f"lora.r={r}", f"lora.alpha={2 * r}", f"output={base.output}-r{r}"]
        )
        t0 = time.monotonic()
        res = run_training(cfg, settings, resume=_resume(args, cfg, settings))
        rows.append(
            (
                r,
                res.completion["trainable_params"],
                time.monotonic() - t0,
                res.completion["final_val_loss"],
                res.completion["peak_memory"],
            )
        )
    print(f"\n{'rank':>5} {'trainable params':>17} {'time':>9} {'val loss':>9} {'peak memory':>12}")
    for r, params, secs, val, peak in rows:
        val_s = f"{val:.4f}" if val is not None else "-"
        print(f"{r:>5} {params:>17,} {secs:>8.1f}s {val_s:>9} {human(peak):>12}")
    return 0


def _overrides_anywhere(parser: argparse.ArgumentParser) -> None:
    """Let key=value overrides come after the flags too (`train C --smoke lr=1e-4`):
    argparse hands positionals that follow an optional back as unrecognised."""

    def parse_known_args(
        args: Any = None, namespace: Any = None
    ) -> tuple[argparse.Namespace, list[str]]:
        ns, extras = argparse.ArgumentParser.parse_known_args(parser, args, namespace)
        ns.overrides = [*(ns.overrides or []), *(a for a in extras if not a.startswith("-"))]
        if isinstance(getattr(ns, "resume", None), str) and ns.resume != "auto":
            ns.overrides.append(ns.resume)  # `--resume lr=1e-4`: a flag, then an override
            ns.resume = True
        return ns, [a for a in extras if a.startswith("-")]

    setattr(parser, "parse_known_args", parse_known_args)  # noqa: B010 (instance override)


def _register_data(sub: Any) -> None:
    data = sub.add_parser("data", help="make, inspect and check chat datasets")
    d = data.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    p = add_command(d, "make-demo", cmd_make_demo)
    p.add_argument("out", help="output JSONL path")
    p.add_argument("--n", type=int, default=200, help="conversations (default 200)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--tools",
        action="store_true",
        help="the tool-calling task instead (weather and calculator functions)",
    )
    for name, handler in (("inspect", cmd_inspect), ("check", cmd_check)):
        p = add_command(d, name, handler)
        p.add_argument("config", help="run config YAML")
        p.add_argument("overrides", nargs="*", metavar="key=value")
        if name == "check":
            add_json_flag(p, "the report")
        if name == "inspect":
            p.add_argument("--index", type=int, default=0, help="sample index in the split")
            p.add_argument("--split", choices=("train", "validation", "test"), default="train")
        _overrides_anywhere(p)


def register(sub: Any) -> None:
    _register_data(sub)

    p = add_command(sub, "train", cmd_train)
    p.add_argument("config", help="run config YAML (or 'sweep')")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. lora.r=16 lr=1e-4")
    p.add_argument("--smoke", action="store_true", help="short run with a pass/fail verdict")
    p.add_argument(
        "--resume",
        nargs="?",
        const=True,
        default=False,
        metavar="auto",
        help="continue from the latest checkpoint; '--resume auto': only if there is one",
    )
    p.add_argument(
        "--overfit", type=int, metavar="N", help="train on N samples until the loss is tiny"
    )
    p.add_argument("--auto-batch", action="store_true", help="largest micro-batch that fits (CUDA)")
    p.add_argument("--ranks", help="sweep only: comma-separated LoRA ranks")
    add_check_flag(p, CHECK_HELP)
    _overrides_anywhere(p)
