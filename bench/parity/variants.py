"""The parity verdict against wrong models (issue 57): the demo adapter's real reference,
replayed against the right adapter and its near misses, in each precision.

Rows: the right adapter; the same adapter at 75% and 50% of its LoRA scale; an adapter of
the same run on attention modules only; early checkpoints of the same run; another run's
adapter (another seed); the base alone. Columns: the precision the served side computes in
(float32, bfloat16, float16) and where it runs (Hugging Face on this machine's CPU or GPU,
emulating vLLM's replay: its top-20 log-probs, a token outside them at the least of them;
and, with --vllm URL, the real vLLM serving each variant as a LoRA adapter). Each cell: the
verdict and its figures. Goal: no wrong variant passes, the right one passes, in every cell.

    LORASTACK_HOME=H python bench/parity/variants.py --runs date-iso,date-attn,date-seed1 \
        --dtypes float32,bfloat16,float16 [--device cuda] [--fixture FILE] > results.json

H holds the runs `lorastack train` published (bench/parity/variants.sh trains them):
date-iso (demo.yaml with checkpoint_every=5 keep_checkpoints=5), date-attn (q/k/v/o only),
date-seed1 (seed=1). `--fixture` writes the reference and every replay, which
libs/lorastack/tests/test_parity_variants.py judges in `make test`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from inference import vllm_api
from inference.engine import EngineSpec, VllmServer
from inference.parity import TOP_LOGPROBS, _forced_at, _Vllm, read_reference, replay_probe
from lorastack.parity import Reference, Replay, judge
from lorastack.settings import CommonSettings
from lorastack.store import open_store
from trainer.publish.checkpoint import step_dir
from trainer.settings import TrainerSettings


def scaled(adapter: Path, share: float, work: Path) -> Path:
    """A copy of `adapter` whose LoRA scale (alpha / r) is `share` of its own."""
    out = work / f"scaled-{share}"
    shutil.copytree(adapter, out)
    cfg = json.loads((out / "adapter_config.json").read_text())
    cfg["lora_alpha"] = cfg["lora_alpha"] * share
    (out / "adapter_config.json").write_text(json.dumps(cfg))
    return out


def replay(model: Any, reference: Reference, device: str) -> list[Replay]:
    """What vLLM's replay (inference.parity.replay_probe) reads, computed by `model`:
    teacher-forced top-20 at every reference position, greedy decoding from the prompt."""
    out = []
    for probe in reference.probes:
        wanted = probe.output_ids
        seq = torch.tensor([probe.prompt_ids + wanted], device=device)
        with torch.inference_mode():
            logits = model(input_ids=seq).logits[0].float()
            lp = torch.log_softmax(logits, dim=-1)
            at = range(len(probe.prompt_ids) - 1, len(probe.prompt_ids) + len(wanted) - 1)
            tops = []
            for i in at:
                v, ix = torch.topk(lp[i], TOP_LOGPROBS)
                tops.append(dict(zip(ix.tolist(), v.tolist(), strict=True)))
            ids = torch.tensor([probe.prompt_ids], device=device)
            gen = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=len(wanted),  # and stops at an end token, as vLLM does
                do_sample=False,
                pad_token_id=0,
            )
        greedy = gen[0, len(probe.prompt_ids) :].tolist()
        chosen = [max(t, key=t.__getitem__) for t in tops]
        forced = [_forced_at(t, w, c) for t, w, c in zip(tops, wanted, chosen, strict=True)]
        out.append(
            Replay(
                rendered_ids=list(probe.prompt_ids),
                encoded_ids=list(probe.prompt_ids),
                forced_logprobs=[f.logprob for f in forced],
                forced_top1=[f.top1 for f in forced],
                greedy_ids=greedy,
                forced_margins=[f.margin for f in forced],
                forced_tokens=chosen,
                rendered_text=probe.prompt_text,
            )
        )
    return out


def vllm_rows(
    base_dir: Path,
    variants: dict[str, Path | None],
    reference: Reference,
    dtype: str,
    device: str,
    work: Path,
    fixture: dict[str, Any],
) -> list[dict[str, Any]]:
    """The vLLM arm: the base served in `dtype` with LoRA on, each variant loaded at runtime
    and the right reference replayed through it (inference.parity.replay_probe, as the
    supervisor does), then unloaded; the base alone replayed as it is. The replays go into
    `fixture` under "vllm-DEVICE DTYPE"."""
    with socket.socket() as sock:  # a free port (libs/testing is not installed on the GPU)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    rows = []
    extra = ["--enforce-eager"] if device == "cuda" else []
    server = VllmServer(EngineSpec(
        model_dir=base_dir, served_name="base", port=port, dtype=dtype, enable_lora=True,
        max_lora_rank=16, workdir=work / f"vllm-{dtype}", extra_args=extra,
        gpu_memory_utilization=0.5,
    ))  # fmt: skip
    with server:
        start = time.monotonic()
        server.wait_ready(timeout_s=900)
        print(f"vLLM {dtype} ready in {time.monotonic() - start:.0f} s", file=sys.stderr)
        for name, folder in variants.items():
            start = time.monotonic()
            served = "base"
            if folder is not None:
                served = "v-" + "".join(c if c.isalnum() else "-" for c in name)
                vllm_api.load_lora(server.base_url, served, folder)
            try:
                vllm = _Vllm(server.base_url, served, None, 120.0, time.monotonic() + 600)
                replays = [replay_probe(vllm, p) for p in reference.probes]
                verdict = judge(name, reference, replays, served_dtype=dtype)
                fixture.setdefault(f"vllm-{device} {dtype}", {})[name] = [
                    _rounded(r) for r in replays
                ]
            finally:
                if folder is not None:
                    vllm_api.unload_lora(server.base_url, served)
            verdict.model = name
            rows.append({
                "variant": name, "served_dtype": dtype, "platform": f"vllm-{device}",
                "wrong": name != "right", "seconds": round(time.monotonic() - start, 1),
                **verdict.as_dict(),
            })  # fmt: skip
            print(f"vllm {dtype:9} {name:28} {summary(verdict)}", file=sys.stderr, flush=True)
    return rows


def _rounded(replay: Replay) -> dict[str, Any]:
    """A replay as JSON, its nats to 5 decimals (the fixture stays small)."""
    out = dict(replay.__dict__)
    out["forced_logprobs"] = [round(v, 5) for v in replay.forced_logprobs]
    out["forced_margins"] = [None if v is None else round(v, 5) for v in replay.forced_margins]
    return out


def summary(verdict: Any) -> str:
    return (
        f"{'PASS' if verdict.ok else 'fail'}  top1 {verdict.top1_agreement:.3f} max "
        f"{verdict.max_abs_logprob_delta:.3f} mean {verdict.mean_abs_logprob_delta:.3f} "
        f"ratio {verdict.control_ratio} greedy "
        f"{verdict.greedy_identical}+{verdict.greedy_near_ties}/{verdict.probes}"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", default="date-iso,date-attn,date-seed1")
    ap.add_argument("--dtypes", default="float32,bfloat16,float16")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--checkpoints", default="10,15", help="early steps of the first run")
    ap.add_argument("--fixture", type=Path, help="write the reference and every replay here")
    ap.add_argument("--vllm-dtypes", default="", help="also serve each variant by vLLM in these")
    ap.add_argument("--hf", default="1", help="0: the vLLM arm alone")
    args = ap.parse_args()
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    store = open_store(CommonSettings())
    right, attn, other = args.runs.split(",")
    adapter = store.fetch(store.resolve(f"{right}/adapter"))
    reference = read_reference(adapter)
    assert reference is not None and reference.format == 2, "train with this code first"
    base_dir = store.fetch(store.resolve("smollm2-135m-instruct"))
    work = Path(tempfile.mkdtemp())
    ckpt_root = TrainerSettings().resolved_runs_dir / right / "checkpoints"
    variants: dict[str, Path | None] = {
        "right": adapter,
        "scale 0.75": scaled(adapter, 0.75, work),
        "scale 0.5": scaled(adapter, 0.5, work),
        "attention only": store.fetch(store.resolve(f"{attn}/adapter")),
        "another run (seed 1)": store.fetch(store.resolve(f"{other}/adapter")),
        "base alone": None,
    }
    for step in [int(s) for s in args.checkpoints.split(",") if s]:
        folder = step_dir(ckpt_root, step) / "adapter"
        if folder.is_dir():
            variants[f"checkpoint step {step} of 20"] = folder
        else:
            print(f"no checkpoint of step {step} under {ckpt_root}", file=sys.stderr)
    rows: list[dict[str, Any]] = []
    fixture: dict[str, Any] = {"reference": json.loads(reference.model_dump_json()), "replays": {}}
    for dtype in [d for d in args.vllm_dtypes.split(",") if d]:
        rows += vllm_rows(
            base_dir, variants, reference, dtype, args.device, work, fixture["replays"]
        )
    for dtype in args.dtypes.split(",") if args.hf == "1" else []:
        base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=getattr(torch, dtype))
        base.to(args.device).eval()
        for name, folder in variants.items():
            start = time.monotonic()
            model = base if folder is None else PeftModel.from_pretrained(base, folder).eval()
            replays = replay(model, reference, args.device)
            if folder is not None:
                base = model.unload()  # the base without this adapter, for the next
            verdict = judge(name, reference, replays, served_dtype=dtype)
            row = {
                "variant": name,
                "served_dtype": dtype,
                "platform": f"hf-{args.device}",
                "wrong": name != "right",
                "seconds": round(time.monotonic() - start, 1),
                **verdict.as_dict(),
            }
            rows.append(row)
            fixture["replays"].setdefault(dtype, {})[name] = [_rounded(r) for r in replays]
            print(f"hf {dtype:9} {name:28} {summary(verdict)}", file=sys.stderr, flush=True)
    if args.fixture:
        args.fixture.write_text(json.dumps(fixture, separators=(",", ":")) + "\n")
    wrong_passed = [(r["variant"], r["served_dtype"]) for r in rows if r["wrong"] and r["ok"]]
    right_refused = [r["served_dtype"] for r in rows if not r["wrong"] and not r["ok"]]
    print(
        json.dumps(
            {
                "reference": {
                    "dtype": reference.dtype,
                    "probes": len(reference.probes),
                    "control_distance": rows[0]["control_distance"] if rows else None,
                },
                "wrong_passed": wrong_passed,
                "right_refused": right_refused,
                "rows": rows,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
