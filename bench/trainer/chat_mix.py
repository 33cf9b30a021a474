"""A chat dataset shaped like users' data: single-turn chats whose token lengths follow
a long tail between 30 and 2,000 tokens (median about 256), written as lorastack's chat
JSONL, with exact lengths under a given tokenizer.

Text is words taken from the docstrings of Python's standard library (the GPU machine
has no corpus); only lengths and their mix matter to throughput. Deterministic for a
(seed, tokenizer, Python version).

`--max-tokens` shrinks the mix for a CPU run: lengths between 30 and that, the median
scaled by the same factor unless `--median` says otherwise.

usage: python3 bench/trainer/chat_mix.py TOKENIZER_DIR OUT.jsonl [--n 4000] [--seed 0]
    [--max-tokens 2000] [--median N]
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
from pathlib import Path
from typing import Any

import numpy as np

MODULES = ("os", "json", "re", "pathlib", "collections", "argparse", "logging", "shutil")
LOW, HIGH, MEDIAN = 30, 2000, 256  # tokens per chat, all turns and template included


def words() -> list[str]:
    found: list[str] = []
    for name in MODULES:
        module = importlib.import_module(name)
        for attr in sorted(dir(module)):
            doc = getattr(getattr(module, attr, None), "__doc__", None)
            if isinstance(doc, str):
                found += re.findall(r"[A-Za-z][a-z]{1,12}", doc)
    return found


def lengths(n: int, seed: int, high: int = HIGH, median: float | None = None) -> list[int]:
    """Token lengths: log-normal around `median` (MEDIAN scaled by high / HIGH when
    unset), clipped to [LOW, high]."""
    if high <= LOW:
        raise ValueError(f"the longest chat ({high} tokens) must be above {LOW}")
    centre = MEDIAN * high / HIGH if median is None else median
    rng = np.random.default_rng(seed)
    return [int(x) for x in np.clip(rng.lognormal(np.log(centre), 0.9, n), LOW, high)]


def text_of(tokenizer: Any, pool: list[int], rng: np.random.Generator, tokens: int) -> str:
    start = int(rng.integers(0, len(pool) - tokens))
    return str(tokenizer.decode(pool[start : start + tokens])).strip()


def count(tokenizer: Any, messages: list[dict[str, str]]) -> int:
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def make(
    tokenizer: Any, n: int, seed: int, high: int = HIGH, median: float | None = None
) -> list[dict[str, Any]]:
    pool = tokenizer(" ".join(words()), add_special_tokens=False)["input_ids"]
    rng = np.random.default_rng(seed + 1)
    overhead = count(
        tokenizer, [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    )
    rows = []
    for total in lengths(n, seed, high, median):
        body = max(4, total - overhead)
        answer = max(2, int(body * rng.uniform(0.2, 0.6)))  # the supervised share
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": text_of(tokenizer, pool, rng, body - answer)},
                    {"role": "assistant", "content": text_of(tokenizer, pool, rng, answer)},
                ]
            }
        )
    return rows


def main() -> int:
    from transformers import AutoTokenizer

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("tokenizer")
    ap.add_argument("out", type=Path)
    ap.add_argument("--n", type=int, default=4000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-tokens", type=int, default=HIGH, help=f"longest chat (> {LOW})")
    ap.add_argument("--median", type=float, help="median length (default: scaled with the max)")
    args = ap.parse_args()
    if args.max_tokens <= LOW:
        ap.error(f"--max-tokens must be above {LOW}")
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    rows = make(tokenizer, args.n, args.seed, args.max_tokens, args.median)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    sizes = sorted(count(tokenizer, r["messages"]) for r in rows)
    shape = {"median": sizes[len(sizes) // 2], "p90": sizes[len(sizes) * 9 // 10]}
    print(json.dumps({"chats": len(rows), "tokens": sum(sizes), **shape, "max": sizes[-1]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
