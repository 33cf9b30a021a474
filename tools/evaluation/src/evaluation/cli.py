"""`lorastack eval`, `lorastack loadtest` and `lorastack cost`: flags to configs, results
to the terminal. Heavy imports (numpy, httpx, matplotlib, transformers) stay inside the
handlers so `lorastack --help` stays fast."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from lorastack.settings import CommonSettings
from lorastack.subcommands import add_command

# the flags that set the eval config field of the same name (space-separated)
_EVAL_FIELDS = (
    "base_url api_key test base_model lora_model system_prompt max_tokens concurrency "
    "confidence resamples seed limit adapter primary_metric"
)
# the flags that set the load-test config field of the same name (space-separated)
_LOADTEST_FIELDS = (
    "base_url model api_key endpoint max_concurrency requests max_duration_s warmup input_len "
    "output_len tokenizer slo_ttft_ms slo_tpot_ms metrics_url temperature timeout_s seed "
    "processes"
)


def cmd_eval(args: argparse.Namespace) -> int:
    """base model + prompt vs LoRA on the frozen test split, with bootstrap verdicts

    Ask both models every test prompt through an OpenAI-compatible endpoint (greedy), score
    the answers and decide per metric from a paired bootstrap CI.
    """
    from evaluation.eval_config import load_eval_config
    from evaluation.eval_run import default_report_name, run_eval
    from evaluation.verdict import minimum_items
    from lorastack.store import open_store

    overrides = _flag_values(args, _EVAL_FIELDS)
    if args.scorer:
        overrides["scorers"] = args.scorer
    if args.few_shot:
        overrides["few_shot"] = [_parse_shot(s) for s in args.few_shot]
    config = load_eval_config(Path(args.config) if args.config else None, overrides)
    floor = minimum_items(config.confidence)
    if config.limit is not None and config.limit < floor:
        # still run (a quick check of the endpoint and scorers), but say it up front
        print(
            f"note: --limit {config.limit} is under the {floor} paired items an exact test "
            f"needs at {config.confidence:.0%} confidence: every verdict will be 'too few "
            "items', and lorastack promote refuses it",
            file=sys.stderr,
        )
    store = open_store(CommonSettings())
    publish = None if args.no_publish else (args.publish or default_report_name(config.test))
    out = Path(args.out)
    report = run_eval(config, out_dir=out, store=store, publish_as=publish)
    _print_eval(report, config.primary_metric)
    print(f"report: {out / 'report.md'}")
    if report.published:
        print(f"published: {report.published}")
    return 0


def _flag_values(args: argparse.Namespace, names: str) -> dict[str, Any]:
    """The values of the flags `names` (argparse's dest names, space-separated), None
    where not given."""
    return {name: getattr(args, name) for name in names.split()}


def _print_eval(report: Any, primary_metric: str | None) -> None:
    print(f"n = {report.n} paired items from {report.test.ref} ({report.test.digest[:19]}…)")
    print(f"{'METRIC':14} {'BASELINE':>8} {'LORA':>8} {'DIFF':>8}  {'CI':19} VERDICT")
    for name, m in report.metrics.items():
        ci = f"[{m.ci_low:+.3f}, {m.ci_high:+.3f}]"
        print(
            f"{name:14} {m.baseline_mean:8.3f} {m.candidate_mean:8.3f} "
            f"{m.mean_difference:+8.3f}  {ci:19} {m.verdict}"
            + (f" (n = {m.n} < {m.min_items})" if m.verdict == "too few items" else "")
            + ("  (primary)" if name == primary_metric else "")
        )


def _parse_shot(text: str) -> dict[str, str]:
    from lorastack.errors import ConfigError

    user, sep, assistant = text.partition("=>")
    if not sep or not user.strip() or not assistant.strip():
        raise ConfigError(
            f"few-shot example {text!r} has no '=>'", "write --few-shot 'USER TEXT => ANSWER'"
        )
    return {"user": user.strip(), "assistant": assistant.strip()}


def _register_eval(sub: Any) -> None:
    p = add_command(sub, "eval", cmd_eval)
    p.add_argument("--config", help="YAML file with the fields below (flags override it)")
    p.add_argument("--base-url", help="OpenAI-compatible endpoint, e.g. http://127.0.0.1:8080")
    p.add_argument("--api-key", help="bearer token, if the endpoint needs one")
    p.add_argument("--test", help="frozen test split: store ref <run>/test[:V] or a test.jsonl")
    p.add_argument("--base-model", help="served name of the base model (baseline)")
    p.add_argument("--lora-model", help="served name of the adapter or merged model")
    p.add_argument("--system-prompt", help="baseline system prompt")
    p.add_argument(
        "--few-shot", action="append", metavar="'USER => ANSWER'", help="baseline example"
    )
    p.add_argument(
        "--scorer",
        action="append",
        metavar="NAME[:PATTERN]",
        help="exact, normalised, contains, regex:PATTERN, json_valid, "
        "tool_call[:keys|equal] (repeat; default exact, normalised, contains)",
    )
    p.add_argument("--max-tokens", type=int, help="tokens per answer (default 128)")
    p.add_argument("--concurrency", type=int, help="requests in flight (default 4)")
    p.add_argument("--confidence", type=float, help="CI level (default 0.95)")
    p.add_argument("--resamples", type=int, help="bootstrap resamples (default 2000)")
    p.add_argument("--seed", type=int, help="bootstrap and sampling seed (default 0)")
    p.add_argument("--limit", type=int, help="evaluate the first N items only")
    p.add_argument("--adapter", help="adapter ref or folder: training/validation numbers")
    p.add_argument(
        "--primary-metric", help="scorer that `lorastack promote` decides on (default: the first)"
    )
    p.add_argument("--out", default="eval-report", help="folder for report.md/json, samples.jsonl")
    p.add_argument("--publish", metavar="NAME", help="report artifact name (default <run>/eval)")
    p.add_argument("--no-publish", action="store_true", help="write --out only")


def _floats(text: str) -> list[float]:
    from lorastack.errors import ConfigError

    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise ConfigError(
            f"{text!r} is not a comma-separated list of numbers", "e.g. 1,2,4,8"
        ) from e


def cmd_loadtest(args: argparse.Namespace) -> int:
    """streamed load sweep against an OpenAI-compatible endpoint (TTFT, TPOT, ITL, ...)

    Sweep concurrency levels and/or Poisson request rates; per level report TTFT, TPOT, ITL
    and E2E percentiles, throughput, goodput and server peaks.
    """
    from pydantic import ValidationError

    from evaluation.loadtest_config import LoadtestConfig
    from evaluation.loadtest_report import PNG, render_text, write_outputs
    from evaluation.loadtest_run import run_loadtest
    from lorastack.errors import ConfigError, field_errors

    fields = _flag_values(args, _LOADTEST_FIELDS)
    fields["concurrency"] = [int(c) for c in _floats(args.concurrency)] if args.concurrency else []
    fields["rates"] = _floats(args.rate) if args.rate else []
    fields["ignore_eos"] = not args.no_ignore_eos
    fields["prompts_file"] = args.prompts
    try:
        config = LoadtestConfig.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as e:
        msgs = "; ".join(f"{where}: {what}" for where, what in field_errors(e, "flags"))
        raise ConfigError(f"invalid load test: {msgs}", "see 'lorastack loadtest --help'") from e
    result = run_loadtest(config)
    out = Path(args.out)
    write_outputs(result, out)
    print()
    print(render_text(result))
    print(
        f"\nwritten: {out / 'report.md'}, {out / 'report.json'}, {out / PNG}, {out / 'samples.jsonl'}"
    )
    if args.publish:
        from lorastack.store import open_store

        m = open_store(CommonSettings()).publish(
            out, kind="report", name=args.publish, service="evaluation", config=result.config
        )
        print(f"published: {m.ref}")
    return 0


def _register_loadtest(sub: Any) -> None:
    p = add_command(sub, "loadtest", cmd_loadtest)
    p.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000 (vLLM or gateway)")
    p.add_argument("--model", required=True, help="served model name")
    p.add_argument("--api-key", help="bearer token, if the endpoint needs one")
    p.add_argument("--endpoint", choices=["chat", "completions"], help="default chat")
    p.add_argument("--concurrency", help="levels of requests in flight, e.g. 1,2,4,8")
    p.add_argument("--rate", help="levels of Poisson request rates per second, e.g. 1,2,4")
    p.add_argument("--max-concurrency", type=int, help="cap on in-flight requests at rate levels")
    p.add_argument("--requests", type=int, help="requests per level (default 32)")
    p.add_argument("--max-duration-s", type=float, help="no new request after this (default 600)")
    p.add_argument("--warmup", type=int, help="uncounted requests first (default 1)")
    p.add_argument("--input-len", type=int, help="synthetic prompt tokens (default 128)")
    p.add_argument("--output-len", type=int, help="max_tokens per request (default 64)")
    p.add_argument("--no-ignore-eos", action="store_true", help="let the model stop early")
    p.add_argument("--prompts", help="JSONL of {prompt} or {messages} instead of synthetic")
    p.add_argument("--tokenizer", help="model folder: exact prompt lengths and token counts")
    p.add_argument("--slo-ttft-ms", type=float, help="goodput SLO on TTFT")
    p.add_argument("--slo-tpot-ms", type=float, help="goodput SLO on TPOT")
    p.add_argument("--metrics-url", help="the server's /metrics, sampled during each level")
    p.add_argument("--temperature", type=float, help="default 0")
    p.add_argument("--timeout-s", type=float, help="per request (default 600)")
    p.add_argument("--seed", type=int, help="prompts and arrivals (default 0)")
    p.add_argument(
        "--processes",
        type=int,
        help="client processes sharing each level (default 1): one tops out near a core, a"
        " few thousand streamed tokens a second; the report says when it was the limit",
    )
    p.add_argument("--out", default="loadtest", help="folder for report.md/json, PNG, samples")
    p.add_argument("--publish", metavar="NAME", help="also publish as a report artifact")


def _print_cost(report: Any) -> None:
    print(f"{report.title} ({report.currency})")
    width = max(len(x.item) for x in report.lines)
    for x in report.lines:
        print(f"  {x.item:{width}}  {x.amount:12.4f}   = {x.formula}")
    print(f"  {'total':{width}}  {report.total:12.4f}")
    print("assumptions:")
    for a in report.assumptions:
        print(f"  - {a}")


def _in_folder(path: Path, file_name: str) -> Path:
    """`path`, or its file `file_name` where `path` is a folder."""
    return path / file_name if path.is_dir() else path


def _read_json(path: Path) -> Any:
    import json

    from lorastack.errors import ConfigError, NotFound

    if not path.is_file():
        raise NotFound(f"{path} does not exist", "give the path of the JSON file")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}", "give the file the tool wrote") from e


def cmd_cost_estimate(args: argparse.Namespace) -> int:
    """before a run: steps x s/step x price + storage + allowance"""
    from evaluation.cost import estimate_training, steps_for, time_warm_steps
    from lorastack.errors import ConfigError
    from lorastack.run_record import read_steps

    if args.steps is None and args.examples is None:
        raise ConfigError("give --steps, or --examples with --batch-size and --epochs")
    steps = args.steps or steps_for(args.examples, args.batch_size, args.epochs)
    if args.seconds_per_step is not None:
        sps, source = args.seconds_per_step, "given with --seconds-per-step"
    elif args.metrics:
        folder = Path(args.metrics)
        records = [r.model_dump() for r in read_steps(folder)]
        timing = time_warm_steps(records, args.warmup_steps)
        sps = timing.seconds_per_step
        source = (
            f"mean of {timing.warm_steps} warm steps in {folder} (median {timing.median_s:.4g} s; "
            f"first {timing.skipped_steps} skipped as warm-up)"
        )
    else:
        raise ConfigError(
            "no step time", "give --seconds-per-step, or --metrics DIR of a short (smoke) run"
        )
    report = estimate_training(
        steps=steps,
        seconds_per_step=sps,
        price_per_gpu_hour=args.price_per_gpu_hour,
        gpus=args.gpus,
        storage_gb=args.storage_gb,
        price_per_gb_month=args.price_per_gb_month,
        storage_months=args.months,
        setup_hours=args.setup_hours,
        idle_fraction=args.idle_fraction,
        currency=args.currency,
        timing_source=source,
    )
    _print_cost(report)
    return 0


def cmd_cost_actual(args: argparse.Namespace) -> int:
    """after a run: billed time x price from training-complete.json"""
    from evaluation.cost import actual_training

    path = Path(args.source)
    if not path.exists():
        from lorastack.store import open_store

        store = open_store(CommonSettings())
        path = store.fetch(store.resolve(args.source))
    report = actual_training(
        _read_json(_in_folder(path, "training-complete.json")),
        price_per_gpu_hour=args.price_per_gpu_hour,
        currency=args.currency,
    )
    _print_cost(report)
    return 0


def cmd_cost_serving(args: argparse.Namespace) -> int:
    """price per hour / measured throughput -> cost per 1M tokens"""
    from evaluation.cost import serving_costs

    path = _in_folder(Path(args.loadtest), "report.json")
    rows = serving_costs(_read_json(path), args.price_per_hour)
    print(f"serving cost at {args.price_per_hour:g} {args.currency}/h, from {path}")
    print(
        f"  {'LEVEL':10} {'OUT TOK/S':>10} {'TTFT p50 ms':>12} {'TPOT p50 ms':>12} {'ERR':>4}  PER 1M OUTPUT TOKENS"
    )
    for r in rows:
        ttft = f"{r.ttft_p50_ms:.0f}" if r.ttft_p50_ms is not None else "-"
        tpot = f"{r.tpot_p50_ms:.1f}" if r.tpot_p50_ms is not None else "-"
        print(
            f"  {r.level:10} {r.output_tokens_per_s:10.1f} {ttft:>12} {tpot:>12} {r.errors:4}  {r.cost_per_million:.4f} {args.currency}"
        )
    print(
        "  formula: price/h / (output tokens/s x 3600) x 1e6; the machine is assumed busy at that "
        "level all the time (idle time, prompts and other models not counted)"
    )
    return 0


def _register_cost(sub: Any) -> None:
    p = sub.add_parser("cost", help="cost before a run, after it, and per million served tokens")
    s = p.add_subparsers(dest="cost_command", metavar="ACTION", required=True)

    e = add_command(s, "estimate", cmd_cost_estimate)
    e.add_argument("--steps", type=int, help="optimizer steps of the full run")
    e.add_argument("--examples", type=int, help="training examples (with --batch-size, --epochs)")
    e.add_argument("--batch-size", type=int, default=8, help="examples per optimizer step")
    e.add_argument("--epochs", type=float, default=1.0)
    e.add_argument("--seconds-per-step", type=float, help="measured on a short warm run")
    e.add_argument("--metrics", help="folder with metrics-step-N.json of a short (smoke) run")
    e.add_argument("--warmup-steps", type=int, default=2, help="first steps left out (default 2)")
    e.add_argument("--price-per-gpu-hour", type=float, required=True)
    e.add_argument("--gpus", type=int, default=1)
    e.add_argument("--storage-gb", type=float, default=0.0, help="artifacts kept (GB)")
    e.add_argument("--price-per-gb-month", type=float, default=0.0)
    e.add_argument("--months", type=float, default=1.0, help="months the artifacts are kept")
    e.add_argument("--setup-hours", type=float, default=0.25, help="per GPU (default 0.25)")
    e.add_argument("--idle-fraction", type=float, default=0.10, help="of compute (default 0.10)")
    e.add_argument("--currency", default="USD")

    a = add_command(s, "actual", cmd_cost_actual)
    a.add_argument("source", help="training-complete.json, its run folder, or an adapter ref")
    a.add_argument("--price-per-gpu-hour", type=float, help="default: the price the run recorded")
    a.add_argument("--currency", default="USD")

    v = add_command(s, "serving", cmd_cost_serving)
    v.add_argument("loadtest", help="report.json of 'lorastack loadtest' (or its folder)")
    v.add_argument("--price-per-hour", type=float, required=True, help="for the whole server")
    v.add_argument("--currency", default="USD")


def register(sub: Any) -> None:
    from evaluation.promote_cli import register as register_promote

    _register_eval(sub)
    _register_loadtest(sub)
    _register_cost(sub)
    register_promote(sub)
