"""Parity of adapters of Llama-3.1-8B's layer shape through CUDA vLLM's LoRA kernels (issue 46).

The demo's 135M model says little about vLLM's LoRA path at the sizes users serve, so this
builds what bench/serving does (random bf16 weights of Llama-3.1-8B's layer shape, the real
SmolLM2 tokenizer and chat template, random r=16 adapters on all seven projections), then
follows the product's path:

  1. the base through `lorastack model import`;
  2. each adapter's parity reference recorded by the trainer's own code
     (trainer.publish.reference.record_reference), as `lorastack train` writes it: adapter 1
     on the base in bf16 (LoRA), adapter 2 on the base in nf4 (QLoRA: trained against 4-bit
     weights, served on the unquantised base);
  3. both published with their references, served by `lorastack serve` (the supervisor,
     `parity: auto`) in the dtype lorastack picks, once per arm (ARMS: eager, vLLM's
     compiled CUDA graphs, and the base quantised to nf4 by vLLM as it loads); the
     supervisor checks both before it is ready; /status says what it found;
  4. a negative control: adapter 1's reference replayed against the base model alone
     (what a server that silently dropped the adapter would answer) must fail.

Random weights need one change to stand for a trained model: at the default init the
logits have a standard deviation of ~1.3 nats over 49k tokens, so the top two are often
within bf16's rounding and greedy decoding follows ties rather than weights. The output
head is scaled (--head-scale, default 8) so the next-token distribution is peaked as a
trained model's is; the JSON records the reference's median top-1 log-probability.

  python3 bench/parity/llama_shape.py --tokenizer DIR --layers 8 --out $OUT/llama.json

Needs torch, transformers, peft, bitsandbytes, vLLM and lorastack (with the trainer) on the
GPU machine (bench/parity/README.md). Not a test: nothing here runs in CI.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "serving"))
from gpu_serving import (  # bench/serving is not a package
    BASE,
    SERVED,
    VLLM,
    log,
    make_model,
    run,
    serve_config,
    start,
    stop,
    wait_ready,
)

# vLLM's modes: eager, its default (compiled + CUDA graphs), and eager on the base quantised
# to nf4 as it loads (bitsandbytes, as QLoRA trained adapter 2 against it)
ARMS = {
    "eager": ["--enforce-eager"],
    "compiled": [],
    "nf4": ["--enforce-eager", "--quantization", "bitsandbytes"],
}
ADAPTERS = {"adapter": ("bench/adapter", "none"), "adapter2": ("bench2/adapter", "nf4")}
# held-out-like prompts in the shapes users send: a system prompt or none, short and long turns
PROMPTS = [
    (None, "Convert 2045-09-30 to DD/MM/YYYY."),
    ("You are a terse assistant.", "What is the capital of France?"),
    (None, "Write a haiku about GPUs."),
    ("Answer in JSON.", "List three primary colours."),
    (None, "Summarise: the gateway relays tokens from vLLM to the client as they arrive."),
    ("You are a helpful assistant.", "Explain LoRA in one sentence."),
    (None, "Translate 'good morning' into French and Japanese."),
    ("You only answer with numbers.", "How many days are in a leap year?"),
]


def conversations() -> list[Any]:
    from lorastack.chat_data import Conversation

    out = []
    for system, user in PROMPTS:
        messages = [{"role": "system", "content": system}] if system else []
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": "-"}]
        out.append(Conversation.model_validate({"messages": messages}))
    return out


def peak_head(work: Path, scale: float) -> None:
    """Scale lm_head in the saved model (see the module docstring)."""
    from safetensors.torch import load_file, save_file

    for f in sorted((work / "model").glob("*.safetensors")):
        tensors = load_file(f)
        if "lm_head.weight" in tensors:
            tensors["lm_head.weight"] = tensors["lm_head.weight"] * scale
            save_file(tensors, f, metadata={"format": "pt"})


def record(work: Path, base_digest: str, tokenizer_dir: Path) -> dict[str, Any]:
    """The trainer's reference for each adapter, written into its folder."""
    import torch
    from transformers import AutoTokenizer

    from trainer.config import RunConfig
    from trainer.publish.reference import record_reference, write_reference

    tokenizer = AutoTokenizer.from_pretrained(work / "model")
    dataset = work / "unused.jsonl"
    dataset.write_text("")
    out: dict[str, Any] = {}
    for folder, (_, quantization) in ADAPTERS.items():
        start_s = time.monotonic()
        config = RunConfig.model_validate(
            {"dataset": {"path": str(dataset)}, "quantization": quantization}
        )
        reference = record_reference(
            base_dir=work / "model",
            adapter_dir=work / folder,
            config=config,
            device=torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu"),
            tokenizer=tokenizer,
            conversations=conversations(),
            base_digest=base_digest,
        )
        write_reference(reference, work / folder)
        firsts = [p.output_logprobs[0] for p in reference.probes]
        every = [v for p in reference.probes for v in p.output_logprobs]
        out[folder] = {
            "quantization": quantization,
            "dtype": reference.dtype,
            "seconds": round(time.monotonic() - start_s, 1),
            "tokens": len(every),
            "median_logprob_of_greedy_token": round(statistics.median(every), 3),
            "median_first_token_logprob": round(statistics.median(firsts), 3),
            "sample": reference.probes[0].output_text[:80],
        }
        log(f"reference {folder}: {out[folder]}")
    del tokenizer
    torch.cuda.empty_cache()
    return out


def publish(work: Path, env: dict[str, str]) -> dict[str, Any]:
    """The base as `lorastack model import` stores it; returns its ref and digest."""
    run(["lorastack", "model", "import", str(work / "model"), "--name", BASE], env,
        work / "import.log")  # fmt: skip
    from lorastack.settings import CommonSettings
    from lorastack.store import open_store

    base = open_store(CommonSettings(home=Path(env["LORASTACK_HOME"]))).resolve(BASE)
    return {"ref": base.ref, "digest": base.digest}


def publish_adapters(work: Path, env: dict[str, str], base_ref: str) -> list[str]:
    from lorastack.settings import CommonSettings
    from lorastack.store import open_store

    store = open_store(CommonSettings(home=Path(env["LORASTACK_HOME"])))
    base = store.resolve(base_ref)
    refs = []
    for folder, (name, _) in ADAPTERS.items():
        cfg = work / folder / "adapter_config.json"
        data = json.loads(cfg.read_text())
        data["base_model_name_or_path"] = base.ref
        cfg.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
        m = store.publish(work / folder, kind="adapter", name=name, service="trainer",
                          parents=[base.as_parent("base")], metadata={"lora_r": 16})  # fmt: skip
        refs.append(m.ref)
    return refs


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", type=Path, required=True)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--head-scale", type=float, default=8.0)
    ap.add_argument("--arms", default="eager,compiled,nf4", help="ARMS to run, in order")
    ap.add_argument("--work", type=Path, default=Path("/tmp/parity-llama"))
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    work: Path = args.work
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    env = dict(os.environ, LORASTACK_HOME=str(work / "home"), PYTHONUNBUFFERED="1")
    result: dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                              "head_scale": args.head_scale}  # fmt: skip

    def save() -> None:
        args.out.write_text(json.dumps(result, indent=2, default=str) + "\n")

    import torch
    import vllm

    from inference.parity import check
    from lorastack.parity import Reference

    result["versions"] = {"vllm": vllm.__version__, "torch": torch.__version__,
                          "gpu": torch.cuda.get_device_name(0)}  # fmt: skip
    result["model"] = make_model(args.tokenizer, args.layers, work)
    peak_head(work, args.head_scale)
    result["base"] = publish(work, env)
    result["references"] = record(work, result["base"]["digest"], args.tokenizer)
    refs = publish_adapters(work, env, result["base"]["ref"])
    log(f"published {refs}")
    save()
    for arm in args.arms.split(","):
        extra = ARMS[arm]
        t0 = time.monotonic()
        proc = start(["lorastack", "serve", str(serve_config(work, arm, extra, refs))], env,
                     work / f"{arm}.log")  # fmt: skip
        try:
            ready = wait_ready(work, t0, 420)
            status = ready.pop("status")
            arm_out: dict[str, Any] = {
                "ready_s": ready["ready_s"],
                "state": status.get("state"),
                "dtype": status.get("dtype"),
                "parity": status.get("parity"),
                "adapters": status.get("adapters"),
                "last_error": status.get("last_error"),
            }
            if ready["ready_s"] is not None:
                # the negative control: adapter 1's answers asked of the base alone
                reference = Reference.model_validate_json(
                    (work / "adapter" / "parity-reference.json").read_bytes()
                )
                verdict = check(f"http://127.0.0.1:{VLLM}", SERVED, reference,
                                served_dtype=(status.get("dtype") or {}).get("served", "bfloat16"))  # fmt: skip
                arm_out["base_against_adapter_reference"] = verdict.as_dict()
            else:
                arm_out["log_tail"] = (work / "serve" / "vllm.log").read_text()[-3000:]
            result[arm] = arm_out
            log(f"{arm}: {json.dumps(arm_out, default=str)[:2000]}")
        except (httpx.HTTPError, OSError, ValueError) as e:
            result[arm] = {"error": f"{type(e).__name__}: {e}"}
        finally:
            stop(proc)
            shutil.rmtree(work / "serve", ignore_errors=True)
        save()
    save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
