"""Replay parity references through a running vLLM and print each verdict as JSON (issue 46).

    python bench/parity/check_served.py --url http://127.0.0.1:8010 --dtype float32 \
        NAME=REFERENCE.json [NAME=REFERENCE.json ...]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from inference.parity import check
from lorastack.parity import Reference


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--dtype", required=True, help="the dtype vLLM serves in")
    ap.add_argument("--label", default="")
    ap.add_argument("pairs", nargs="+", help="served NAME=path of its parity-reference.json")
    args = ap.parse_args()
    for pair in args.pairs:
        name, _, path = pair.partition("=")
        reference = Reference.model_validate_json(Path(path).read_bytes())
        start = time.monotonic()
        try:
            verdict = check(args.url, name, reference, served_dtype=args.dtype).as_dict()
        except Exception as e:  # a diagnosis: report and go on with the next
            verdict = {"model": name, "error": f"{type(e).__name__}: {e}"}
        verdict["seconds"] = round(time.monotonic() - start, 2)
        verdict["label"] = args.label
        verdict["reference_dtype"] = reference.dtype
        print(json.dumps(verdict), flush=True)


if __name__ == "__main__":
    main()
