"""Build the side-by-side table of `lorastack loadtest` vs `vllm bench serve` results.

    .venv/bin/python bench/loadtest/side_by_side.py DIR:TAG [DIR:TAG ...]

Per run: each tool's own medians. Pooled: medians over all requests of all TAGs of one
concurrency (lorastack from samples.jsonl, vllm from its --save-detailed lists), which
averages out the load other processes put on the shared machine between runs.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def ours(d: Path) -> tuple[dict[str, float], list[dict[str, float]]]:
    lv = json.loads((d / "report.json").read_text())["levels"][0]
    med = {"ttft": lv["ttft_ms"]["p50"], "tpot": lv["tpot_ms"]["p50"], "itl": lv["itl_ms"]["p50"],
           "e2e": lv["e2e_ms"]["p50"], "tps": lv["output_tokens_per_s"], "n": lv["completed"]}  # fmt: skip
    rows = []
    for line in (d / "samples.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r["error"]:
            continue
        rows.append({"ttft": r["ttft_s"] * 1e3, "e2e": r["e2e_s"] * 1e3,
                     "tpot": (r["e2e_s"] - r["ttft_s"]) / (r["output_tokens"] - 1) * 1e3})  # fmt: skip
    return med, rows


def theirs(f: Path) -> tuple[dict[str, float], list[dict[str, float]]]:
    v = json.loads(f.read_text())
    med = {"ttft": v["median_ttft_ms"], "tpot": v["median_tpot_ms"], "itl": v["median_itl_ms"],
           "e2e": v["median_e2el_ms"], "tps": v["output_throughput"], "n": v["completed"]}  # fmt: skip
    rows = []
    for ttft, lat, n, err in zip(
        v["ttfts"], v["latencies"], v["output_lens"], v["errors"], strict=True
    ):
        if not err and n > 1:
            rows.append(
                {"ttft": ttft * 1e3, "e2e": lat * 1e3, "tpot": (lat - ttft) / (n - 1) * 1e3}
            )
    return med, rows


def main() -> None:
    runs = [(Path(a.rpartition(":")[0]), a.rpartition(":")[2]) for a in sys.argv[1:]]
    print("| run | tool | n | TTFT p50 ms | TPOT p50 ms | ITL p50 ms | E2E p50 ms | out tok/s |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    pooled: dict[tuple[int, str], list[dict[str, float]]] = {}
    for c in (1, 4):
        for d, tag in runs:
            lt, vb = d / f"lorastack-c{c}-{tag}", d / f"vllm-bench-c{c}-{tag}.json"
            if not lt.is_dir() or not vb.is_file():
                continue
            for tool, (med, rows) in (("lorastack", ours(lt)), ("vllm bench", theirs(vb))):
                pooled.setdefault((c, tool), []).extend(rows)
                print(f"| c={c} {tag} | {tool} | {med['n']} | {med['ttft']:.0f} | {med['tpot']:.1f} "
                      f"| {med['itl']:.1f} | {med['e2e']:.0f} | {med['tps']:.2f} |")  # fmt: skip
    print()
    print(
        "| pooled | n (lorastack / vllm) | TTFT p50 ms lorastack / vllm (diff) | TPOT p50 ms lorastack / vllm (diff) |"
    )
    print("|---|---|---|---|")
    for c in (1, 4):
        a, b = pooled.get((c, "lorastack")), pooled.get((c, "vllm bench"))
        if not a or not b:
            continue
        cells = []
        for k in ("ttft", "tpot"):
            x, y = statistics.median(r[k] for r in a), statistics.median(r[k] for r in b)
            cells.append(f"{x:.1f} / {y:.1f} ({(x - y) / y:+.1%})")
        print(f"| c={c} | {len(a)} / {len(b)} | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    main()
