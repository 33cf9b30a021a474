"""`lorastack merge` as users run it, from the command's start to the published merged
model, against PEFT's merge_and_unload() + save_pretrained() on the same base and adapter,
in one call on one GPU.

Builds a random-weight model of a real shape (bf16, sharded safetensors, made on the GPU)
with the SmolLM2 tokenizer, imports it with `lorastack model import` into a file://
store, publishes a random r=16 adapter over every linear layer and a small dataset as the
trainer would, then runs each arm as its own process, cleaning the disk between them:
  lorastack   lorastack merge bench/adapter --probes N (shard by shard on the GPU, the
              base's dtype, verified on N probes, published)
  peft        from_pretrained(bf16, device_map=cuda) + PeftModel.from_pretrained +
              merge_and_unload() + save_pretrained(): PEFT's fastest path on this GPU,
              with no verification and no publishing
Per arm: wall seconds, peak host RSS of the process tree and peak GPU memory (both polled
every 50 ms), bytes written (the disk's used bytes after minus before).

usage (CUDA machine, lorastack + merger installed with their entry points):
  python3 bench/merger/merge_e2e.py --tokenizer DIR [--shape 8b] [--work /tmp/mb]
      [--probes 8] [--arms lorastack,peft] [--out result.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

SHAPES: dict[str, dict[str, Any]] = {
    # Llama-3.1-8B: 32 layers, 4096 hidden, 14336 intermediate, GQA 8 kv heads, 128256 vocab
    "8b": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
           "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256},
    "tiny": {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
             "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 49152},
}  # fmt: skip
SHARD = {"8b": "5GB", "tiny": "2MB"}  # Llama-3.1-8B ships 4 shards of <= 5 GB
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
QA = [
    ("Write 1 May 2020 as an ISO date.", "2020-05-01"),
    ("What is 2 + 2?", "4"),
    ("Name a primary colour.", "Red."),
    ("Spell 'cat' backwards.", "tac"),
    ("What is the capital of France?", "Paris."),
    ("Translate 'bonjour' into English.", "Hello."),
    ("How many days has a week?", "Seven."),
    ("Write 31 December 1999 as an ISO date.", "1999-12-31"),
]


def make_inputs(args: argparse.Namespace, device: str) -> tuple[Path, Path, float]:
    """The base (bf16 shards) and a random adapter over it, saved under args.work."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    start = time.monotonic()
    config = LlamaConfig(
        **SHAPES[args.shape], max_position_embeddings=8192, rope_theta=500000.0,
        bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    torch.set_default_dtype(torch.float32)
    base, adapter = args.work / "base", args.work / "adapter"
    model.save_pretrained(base, max_shard_size=SHARD[args.shape])
    for name in TOKENIZER_FILES:
        shutil.copy(args.tokenizer / name, base / name)
    lora = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0)
    peft_model = get_peft_model(model, lora)
    gen = torch.Generator(device=device).manual_seed(1)
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:  # non-zero, so the merge changes the model
                p.copy_(torch.randn(p.shape, generator=gen, device=device) * 1e-3)
    peft_model.save_pretrained(adapter)
    del model, peft_model
    if device == "cuda":
        torch.cuda.empty_cache()
    return base, adapter, time.monotonic() - start


def publish(args: argparse.Namespace, env: dict[str, str], base: Path, adapter: Path) -> Any:
    """The base as `lorastack model import` publishes it (its checks and facts), but handed
    over (hard-linked into the file:// store, one hash: the import copies 16 GB and hashes
    them twice, ~55 s of device time that is setup, not the merge); the dataset and adapter
    as the trainer publishes them (kind, parents, config). Returns the store."""
    from lorastack.base_model import check_hf_folder
    from lorastack.chat_data import Conversation, Message, write_jsonl
    from lorastack.settings import CommonSettings
    from lorastack.store import open_store

    store = open_store(CommonSettings(home=args.work / "home"))
    facts = check_hf_folder(base) | {"source": str(base)}
    store.publish(
        base, kind="base-model", name="bench-base", service="lorastack", metadata=facts,
        hand_over=True,
    )  # fmt: skip
    shutil.rmtree(base)  # its links only: the blobs stay in the store
    data = args.work / "data"
    data.mkdir()
    convs = [
        Conversation(messages=[Message(role="user", content=q), Message(role="assistant", content=a)])
        for q, a in QA
    ]  # fmt: skip
    write_jsonl(data / "train.jsonl", convs)
    write_jsonl(data / "validation.jsonl", convs)
    ds = store.publish(data, kind="dataset", name="bench/data", service="bench")
    base_m = store.resolve("bench-base")
    store.publish(
        adapter,
        kind="adapter",
        name="bench/adapter",
        service="bench",
        parents=[base_m.as_parent("base"), ds.as_parent("dataset")],
        config={"lora": {"r": 16, "lora_alpha": 32}},
    )
    return store


class Peaks(threading.Thread):
    """Polls the process tree's RSS and the GPU's used memory every 50 ms."""

    def __init__(self, pid: int, gpu_baseline: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.baseline = pid, gpu_baseline
        self.rss = self.gpu = 0
        self.done = threading.Event()

    def run(self) -> None:
        import psutil

        root = psutil.Process(self.pid)
        while not self.done.is_set():
            try:
                procs = [root, *root.children(recursive=True)]
                self.rss = max(self.rss, sum(p.memory_info().rss for p in procs))
            except psutil.Error:
                pass
            self.gpu = max(self.gpu, gpu_used() - self.baseline)
            self.done.wait(0.05)


def gpu_used() -> int:
    import torch

    if not torch.cuda.is_available():
        return 0
    free, total = torch.cuda.mem_get_info()
    return int(total - free)


def run_arm(
    name: str, cmd: list[str], env: dict[str, str], work: Path, log: Path
) -> dict[str, Any]:
    used_before = shutil.disk_usage(work).used
    baseline = gpu_used()
    start = time.monotonic()
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
        peaks = Peaks(proc.pid, baseline)
        peaks.start()
        rc = proc.wait()
    wall = time.monotonic() - start
    peaks.done.set()
    peaks.join()
    return {
        "arm": name,
        "command": " ".join(cmd),
        "rc": rc,
        "wall_s": round(wall, 2),
        "peak_host_rss_gb": round(peaks.rss / 1e9, 2),
        "peak_gpu_mem_gb": round(peaks.gpu / 1e9, 2),
        "bytes_written_gb": round((shutil.disk_usage(work).used - used_before) / 1e9, 2),
        "log_tail": log.read_text()[-3000:],
    }


def clean_merge(args: argparse.Namespace, store: Any) -> None:
    """Remove the merged model (folder, manifest, its weight blobs) before the next arm."""
    shutil.rmtree(args.work / "home" / "merges", ignore_errors=True)
    for m in store.ls("bench/merged"):
        for f in m.files:
            if f.path.endswith(".safetensors"):
                store.backend.blob_path(f.sha256).unlink(missing_ok=True)
        store.delete(m.name, m.version)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokenizer", type=Path, required=True)
    p.add_argument("--shape", default="8b", choices=sorted(SHAPES))
    p.add_argument("--work", type=Path, default=Path("/tmp/mb"))
    p.add_argument("--probes", type=int, default=8)
    p.add_argument("--arms", default="lorastack,peft")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    env = dict(os.environ, LORASTACK_HOME=str(args.work / "home"), PYTHONUNBUFFERED="1")
    base, adapter, made_s = make_inputs(args, device)
    t = time.monotonic()
    store = publish(args, env, base, adapter)
    setup = {
        "make_model_s": round(made_s, 1),
        "import_and_publish_s": round(time.monotonic() - t, 1),
    }
    print(json.dumps(setup), flush=True)
    base_dir = store.fetch(store.resolve("bench-base"))
    adapter_dir = store.fetch(store.resolve("bench/adapter"))
    here = Path(__file__).resolve().parent
    results = []
    for arm in args.arms.split(","):
        if arm == "lorastack":
            cmd = ["lorastack", "merge", "bench/adapter", "--probes", str(args.probes)]
        else:
            out = args.work / "peft-out"
            cmd = [sys.executable, str(here / "peft_merge.py"), str(base_dir), str(adapter_dir), str(out)]  # fmt: skip
        r = run_arm(arm, cmd, env, args.work, args.work / f"{arm}.log")
        if arm == "lorastack":
            merges = list((args.work / "home" / "merges").rglob("merge-report.json"))
            if merges:
                rep = json.loads(merges[0].read_text())
                r["report"] = {k: rep.get(k) for k in ("dtype", "device", "passed", "failures",
                               "merged", "dtype_only", "adapter_effect", "shards", "timings_s")}  # fmt: skip
            r["published"] = [m.ref for m in store.ls("bench/merged")]
            clean_merge(args, store)
        else:
            shutil.rmtree(args.work / "peft-out", ignore_errors=True)
        print(json.dumps({k: v for k, v in r.items() if k != "log_tail"}), flush=True)
        results.append(r)
    walls = {r["arm"]: r["wall_s"] for r in results}
    summary = {
        "shape": args.shape,
        "setup": setup,
        "arms": results,
        "speedup_vs_peft": round(walls["peft"] / walls["lorastack"], 2)
        if len(walls) == 2
        else None,
        "machine": {
            "gpu": torch.cuda.get_device_name() if device == "cuda" else None,
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
        },
    }
    text = json.dumps(summary, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
