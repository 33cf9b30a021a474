"""Request-by-request A/B of the two clients' timing on one server: lorastack's
`send_streaming` and vllm bench's `async_request_openai_chat_completions`, alternating,
each request with its own synthetic prompt (no prefix reuse), the same payload shape.
Alternation cancels the drift of a busy shared machine that separate runs suffer from.

    .venv/bin/python bench/loadtest/ab_clients.py PORT MODEL_DIR PAIRS OUT_JSON [SEED [C]]

With C > 1 each turn is a wave of C concurrent requests from one client (the load of
`--concurrency C` / `--max-concurrency C` with fixed output lengths), waves alternating.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

from inference.vllm_launcher import answer_vllm_version

answer_vllm_version()


async def main() -> None:
    import aiohttp
    import httpx
    from vllm.benchmarks.lib.endpoint_request_func import (
        RequestFuncInput,
        async_request_openai_chat_completions,
    )

    from evaluation.loadtest_clients import send_streaming
    from evaluation.loadtest_config import LoadtestConfig
    from evaluation.loadtest_prompts import load_tokenizer, synthetic_prompts
    from evaluation.loadtest_run import build_payload

    port, model_dir, pairs, out = (
        int(sys.argv[1]),
        Path(sys.argv[2]),
        int(sys.argv[3]),
        Path(sys.argv[4]),
    )
    base = f"http://127.0.0.1:{port}"
    url = base + "/v1/chat/completions"
    tok = load_tokenizer(model_dir)
    seed = int(sys.argv[5]) if len(sys.argv) > 5 else 4242  # a new seed per run: no cached prefixes
    conc = int(sys.argv[6]) if len(sys.argv) > 6 else 1  # requests per wave
    prompts = synthetic_prompts(2 * pairs * conc + 1, 128, seed, tok, chat=True)
    cfg = LoadtestConfig(base_url=base, model="smollm2", concurrency=[1], output_len=64)
    rows: dict[str, list[tuple[float, float]]] = {"lorastack": [], "vllm": []}
    async with (
        httpx.AsyncClient(trust_env=False, timeout=600) as hc,
        aiohttp.ClientSession() as session,
    ):
        # warm both connections
        await send_streaming(hc, url, build_payload(cfg, prompts[-1]), index=0,
                             level_start=time.perf_counter(), chat=True, tokenizer=None)  # fmt: skip
        for i in range(pairs):
            order = ("lorastack", "vllm") if i % 2 == 0 else ("vllm", "lorastack")
            for j, tool in enumerate(order):
                wave = [prompts[(2 * i + j) * conc + k] for k in range(conc)]
                if tool == "lorastack":
                    recs = await asyncio.gather(*(
                        send_streaming(hc, url, build_payload(cfg, p), index=i,
                                       level_start=time.perf_counter(), chat=True, tokenizer=None)
                        for p in wave
                    ))  # fmt: skip
                    for r in recs:
                        assert r.ttft_s is not None and r.tpot_s is not None, r.error
                        rows[tool].append((r.ttft_s * 1e3, r.tpot_s * 1e3))
                else:
                    outs = await asyncio.gather(*(
                        async_request_openai_chat_completions(RequestFuncInput(
                            prompt=p.text, api_url=url, prompt_len=128, output_len=64,
                            model=str(model_dir), model_name="smollm2", ignore_eos=True,
                            extra_body={"temperature": 0.0}), session)
                        for p in wave
                    ))  # fmt: skip
                    for o in outs:
                        assert o.success, o.error
                        n = o.output_tokens or 64
                        rows[tool].append((o.ttft * 1e3, (o.latency - o.ttft) / (n - 1) * 1e3))
            print(i, {k: [round(x) for x in v[-1]] for k, v in rows.items()}, flush=True)
    summary = {
        tool: {"n": len(v), "ttft_p50_ms": statistics.median(x[0] for x in v),
               "tpot_p50_ms": statistics.median(x[1] for x in v)}
        for tool, v in rows.items()
    }  # fmt: skip
    for k in ("ttft_p50_ms", "tpot_p50_ms"):
        a, b = summary["lorastack"][k], summary["vllm"][k]
        summary[f"diff_{k}"] = (a - b) / b
    out.write_text(json.dumps({"summary": summary, "pairs": rows}, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    asyncio.run(main())
