"""Exact match of served models on the demo's frozen test split, asked of an OpenAI server
(vLLM directly or the gateway) as `lorastack eval` asks the LoRA: the user turn alone,
temperature 0, max_tokens 24 (issue 46). Prints one JSON line per model.

    python bench/parity/vllm_exact.py --url http://127.0.0.1:8000 --test test.jsonl \
        --model date-iso-v1 --model cpu [--label fp32] [--api-key KEY]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import httpx


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--test", required=True)
    ap.add_argument("--model", action="append", required=True)
    ap.add_argument("--label", default="")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--api-key", default="")
    args = ap.parse_args()
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    rows = [json.loads(line) for line in Path(args.test).read_text().splitlines() if line]
    for model in args.model:
        hits, outputs = 0, []
        for row in rows:
            msgs = row["messages"]
            user = next(m for m in reversed(msgs) if m["role"] == "user")
            body = {
                "model": model,
                "messages": [user],
                "max_tokens": args.max_tokens,
                "temperature": 0,
            }
            r = httpx.post(
                f"{args.url}/v1/chat/completions", json=body, headers=headers, timeout=120
            )
            r.raise_for_status()
            text = r.json()["choices"][0]["message"]["content"] or ""
            hits += text.strip() == msgs[-1]["content"].strip()
            outputs.append(text.strip())
        print(
            json.dumps(
                {
                    "label": args.label,
                    "model": model,
                    "exact": hits / len(rows),
                    "n": len(rows),
                    "outputs": outputs,
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
