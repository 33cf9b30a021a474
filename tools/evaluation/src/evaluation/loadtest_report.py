"""A load test's outputs: the table (with every formula under it), JSON, a PNG.

report.md                 the table, formulas and notes (also printed)
report.json               `LoadtestResult` (per level: percentiles, throughput, server peaks)
samples.jsonl             every request: level, send time, chunk times, tokens, error
throughput-latency.png    output tokens/s against TTFT and TPOT medians, one point per level
"""

from __future__ import annotations

import json
from pathlib import Path

from evaluation.loadtest_run import LoadtestResult
from evaluation.loadtest_stats import FORMULAS, LevelResult, Percentiles

PNG = "throughput-latency.png"


def _trio(p: Percentiles, scale: float = 1.0, digits: int = 0) -> str:
    if p.p50 is None or p.p90 is None or p.p99 is None:
        return "-"
    return "/".join(f"{v * scale:.{digits}f}" for v in (p.p50, p.p90, p.p99))


def _opt(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def table_rows(levels: list[LevelResult]) -> list[list[str]]:
    """The results table: a header row, then one row per level."""
    header = [
        "level", "ok/sent", "err", "TTFT ms p50/p90/p99", "TPOT ms p50/p90/p99",
        "ITL ms p50/p90/p99", "E2E s p50/p90/p99", "out tok/s", "req/s", "goodput req/s",
        "KV peak", "wait peak", "preempt",
    ]  # fmt: skip
    rows = [header]
    for r in levels:
        s = r.server
        rows.append(
            [
                r.level.label,
                f"{r.completed}/{r.requests}",
                str(r.errors),
                _trio(r.ttft_ms),
                _trio(r.tpot_ms, digits=1),
                _trio(r.itl_ms, digits=1),
                _trio(r.e2e_ms, scale=0.001, digits=2),
                f"{r.output_tokens_per_s:.1f}",
                f"{r.requests_per_s:.2f}",
                _opt(r.goodput_rps, ".2f")
                + (f" ({r.good_fraction:.0%})" if r.good_fraction is not None else ""),
                _opt(s.peak_kv_cache_usage if s else None, ".1%"),
                _opt(s.peak_waiting if s else None, ".0f"),
                _opt(s.preemptions if s else None, ".0f"),
            ]
        )
    return rows


def render_markdown(result: LoadtestResult) -> str:
    """The load test as Markdown: setup, the table, the formulas and the notes."""
    c = result.config
    rows = table_rows(result.levels)
    lines = [
        "# Load test",
        "",
        f"- Endpoint: `{result.endpoint}`, model `{c['model']}`, streaming, {result.created}",
        f"- Per level: {c['requests']} requests; prompts: "
        + (
            f"`{c['prompts_file']}`"
            if c.get("prompts_file")
            else f"synthetic, {c['input_len']} input tokens"
        )
        + f"; max_tokens {c['output_len']}, ignore_eos {c['ignore_eos']}, temperature {c['temperature']}",
        f"- SLOs: TTFT <= {c['slo_ttft_ms'] or '-'} ms, TPOT <= {c['slo_tpot_ms'] or '-'} ms; "
        f"metrics from {c['metrics_url'] or '(not sampled)'}",
        "",
        "| " + " | ".join(rows[0]) + " |",
        "|" + "|".join("---" for _ in rows[0]) + "|",
    ]
    lines += ["| " + " | ".join(r) + " |" for r in rows[1:]]
    lines += ["", "Formulas:", ""]
    lines += [f"- {k} = {v}" for k, v in FORMULAS.items()]
    lines += ["- p50/p90/p99: percentiles with linear interpolation over successful requests"]
    counted = {k for r in result.levels for k in r.token_sources}
    lines += [
        f"- output tokens counted from: {', '.join(sorted(counted)) or '-'} (usage field first)"
    ]
    errors = [e for r in result.levels for e in r.error_examples]
    if errors:
        lines += ["", "Errors (examples):", ""] + [f"- {e}" for e in errors[:5]]
    if result.notes:
        lines += ["", "Notes:", ""] + [f"- {n}" for n in result.notes]
    return "\n".join(lines) + "\n"


def render_text(result: LoadtestResult) -> str:
    """The table in aligned columns for the terminal, with the formulas and notes."""
    rows = table_rows(result.levels)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(r, widths, strict=True)) for r in rows]
    lines += [""] + [f"  {k:9} = {v}" for k, v in FORMULAS.items()]
    lines += [f"  note: {n}" for n in result.notes]
    return "\n".join(lines)


def plot(result: LoadtestResult, path: Path) -> None:
    """Plot latency percentiles against output throughput, one point per level, to `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r.output_tokens_per_s for r in result.levels]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, attr in (("TTFT p50", "ttft_ms"), ("TPOT p50", "tpot_ms"), ("ITL p99", "itl_ms")):
        ys = [
            getattr(r, attr).p99 if name.endswith("p99") else getattr(r, attr).p50
            for r in result.levels
        ]
        pts = [(x, y) for x, y in zip(xs, ys, strict=True) if y is not None]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    for r, x in zip(result.levels, xs, strict=True):
        if r.ttft_ms.p50 is not None:
            ax.annotate(
                r.level.label,
                (x, r.ttft_ms.p50),
                textcoords="offset points",
                xytext=(4, 4),
                fontsize=8,
            )
    ax.set_xlabel("output tokens/s (all requests)")
    ax.set_ylabel("latency, ms")
    ax.set_yscale("log")
    ax.set_title(f"{result.config['model']}: throughput vs latency per load level")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(result: LoadtestResult, out_dir: Path) -> None:
    """Write report.json, samples.jsonl, report.md and the plot into `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "report.json").write_text(result.model_dump_json(indent=2) + "\n", encoding="utf-8")
    with (out_dir / "samples.jsonl").open("w", encoding="utf-8") as f:
        for level, records in zip(result.levels, result.records, strict=False):
            for rec in records:
                row = {"level": level.level.label, **rec.model_dump(mode="json")}
                f.write(json.dumps(row) + "\n")
    (out_dir / "report.md").write_text(render_markdown(result), encoding="utf-8")
    plot(result, out_dir / PNG)
