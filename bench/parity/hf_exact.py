"""Exact match of an adapter on the demo's frozen test split with Hugging Face + PEFT greedy
decoding, in a chosen dtype and device: the serving stack taken out of the comparison
(issue 46). Prints one JSON line.

    python bench/parity/hf_exact.py --base DIR --adapter DIR --test test.jsonl \
        --dtype float32 --device cuda [--max-new-tokens 24]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True)
    ap.add_argument("--adapter", required=True)
    ap.add_argument("--test", required=True)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--label", default="")
    args = ap.parse_args()

    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = getattr(torch, args.dtype)
    tok = AutoTokenizer.from_pretrained(args.base)
    model = AutoModelForCausalLM.from_pretrained(args.base, dtype=dtype).to(args.device)
    model = PeftModel.from_pretrained(model, args.adapter).to(args.device).eval()
    rows = [json.loads(line) for line in Path(args.test).read_text().splitlines() if line]
    hits, outputs = 0, []
    start = time.monotonic()
    for row in rows:
        msgs = row["messages"]
        user = next(m for m in reversed(msgs) if m["role"] == "user")
        expected = msgs[-1]["content"]
        ids = tok.apply_chat_template(
            [user], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        inp = torch.tensor([list(ids)], device=args.device)
        with torch.inference_mode():
            out = model.generate(
                input_ids=inp,
                attention_mask=torch.ones_like(inp),
                max_new_tokens=args.max_new_tokens,
                do_sample=False,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id or tok.eos_token_id,
            )
        text = tok.decode(out[0, inp.shape[1] :], skip_special_tokens=True)
        hits += text.strip() == expected.strip()
        outputs.append(text.strip())
    print(
        json.dumps(
            {
                "label": args.label,
                "adapter": args.adapter,
                "dtype": args.dtype,
                "device": args.device,
                "exact": hits / len(rows),
                "n": len(rows),
                "seconds": round(time.monotonic() - start, 1),
                "outputs": outputs,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
