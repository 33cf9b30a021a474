"""The serving check on a CUDA GPU (issue 39), as a user runs it: `lorastack serve` (vLLM
under the supervisor) and `lorastack gateway`, on a random-weight Llama of a real shape
and a random LoRA, both published to a file:// store as `model import` and the trainer
would. Writes one JSON of everything it measured (bench/serving/README.md):

  1. time to /ready, cold (compile, CUDA graphs), and where it goes (vLLM's log lines);
  2. the supervisor's KV estimate beside vLLM's figure (log and cache_config_info);
  3. chat and completions, streamed and not, on the base and the adapter, through the
     gateway; an adapter declared at runtime through the admin API, then served; max_tokens
     over max_model_len refused with the clear 400;
  4. `lorastack loadtest` at 1, 16, 64 and 256 streams, direct to vLLM and through the
     gateway, order alternated per level, each arm its own seed (no prompt shared, so no
     prefix-cache hit crosses arms): the gateway's added TTFT and its throughput ratio
     (`--paired`: both arms at once, half the streams each, in the same vLLM batches);
  5. pressure: vLLM again with --num-gpu-blocks-override 512 (8,192 tokens of KV), 64
     streams of 512 + 128 tokens (41k tokens wanted): direct, then through the gateway
     (a client that honours 429 + Retry-After, as the openai SDK does): preemptions,
     429s, 5xx, goodput.

  python3 bench/serving/gpu_serving.py --tokenizer DIR --layers 8 --out $OUT/serving.json

Needs torch, transformers, peft (the device image), vLLM and lorastack installed
(bench/serving/device_check.sh). Not a test: nothing here runs in CI.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

VLLM, SUP, GW = 8000, 8001, 8080
BASE, ADAPTER, ADAPTER2 = "bench-llama", "bench/adapter", "bench2/adapter"
SERVED = "llama"
MAX_MODEL_LEN = 4096  # tokens
LEVELS = (1, 16, 64, 256)
# requests per arm and round: each arm runs several seconds at every level (the first
# call's 32 requests at 16 streams lasted 0.9 s, too short to tell 0.91x from noise)
REQUESTS = {1: 16, 16: 384, 64: 384, 256: 512}  # 16: 128 gave arms of ~4 s, spread ±12%
INPUT_LEN, OUTPUT_LEN = 512, 128  # tokens per loadtest request
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
# vLLM log lines that say where a cold start goes (printed with the seconds they appeared at)
MILESTONES = re.compile(
    r"Loading weights took|Model loading took|torch.compile take|Compiling a graph|"
    r"Dynamo bytecode transform|Graph capturing finished|init engine|KV cache size|"
    r"Maximum concurrency|Available KV cache memory|Starting vLLM API server|"
    r"Application startup complete|FlashInfer|flashinfer|Error|error"
)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --- model and adapters ------------------------------------------------------------------


def make_model(tokenizer: Path, layers: int, work: Path) -> dict[str, Any]:
    """A random bf16 Llama with Llama-3.1-8B's layer shape, and two random r=16 adapters."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    start = time.monotonic()
    config = LlamaConfig(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=49152,
        max_position_embeddings=8192, rope_theta=500000.0, bos_token_id=1, eos_token_id=2,
        pad_token_id=2, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model_dir = work / "model"
    model.save_pretrained(model_dir)
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer / name, model_dir / name)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    peft_model = get_peft_model(
        model, LoraConfig(r=16, lora_alpha=32, target_modules=targets, lora_dropout=0.0)
    )
    dirs = []
    for seed, name in ((1, "adapter"), (2, "adapter2")):
        torch.manual_seed(seed)
        with torch.no_grad():
            for n, p in peft_model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0.0, 0.02)  # random, so the adapter changes the answers
        out = work / name
        peft_model.save_pretrained(out)
        dirs.append(out)
    del model, peft_model
    torch.cuda.empty_cache()
    return {"seconds": round(time.monotonic() - start, 1), "layers": layers}


def publish(work: Path, env: dict[str, str]) -> dict[str, Any]:
    """The base through `lorastack model import` (as a user would), the adapters as the
    trainer publishes them (kind adapter, parent base, base_model_name_or_path a ref)."""
    start = time.monotonic()
    run(
        ["lorastack", "model", "import", str(work / "model"), "--name", BASE],
        env,
        work / "import.log",
    )
    from lorastack.settings import CommonSettings
    from lorastack.store import open_store

    store = open_store(CommonSettings(home=Path(env["LORASTACK_HOME"])))
    base = store.resolve(BASE)
    refs = []
    for folder, name in ((work / "adapter", ADAPTER), (work / "adapter2", ADAPTER2)):
        cfg = folder / "adapter_config.json"
        data = json.loads(cfg.read_text())
        data["base_model_name_or_path"] = base.ref
        cfg.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
        m = store.publish(
            folder, kind="adapter", name=name, service="trainer",
            parents=[base.as_parent("base")], metadata={"lora_r": 16},
        )  # fmt: skip
        refs.append(m.ref)
    return {"seconds": round(time.monotonic() - start, 1), "base": base.ref, "adapters": refs}


def run(cmd: list[str], env: dict[str, str], logf: Path) -> None:
    with logf.open("w") as f:
        code = subprocess.call(cmd, env=env, stdout=f, stderr=subprocess.STDOUT)
    if code:
        raise SystemExit(f"{' '.join(cmd)} failed ({code}): {logf.read_text()[-3000:]}")


# --- serve and gateway -------------------------------------------------------------------


def serve_config(work: Path, name: str, extra: list[str], adapters: list[str]) -> Path:
    cfg = work / f"{name}.yaml"
    lines = [
        f"model: {BASE}",
        f"served_model_name: {SERVED}",
        f"adapters: [{', '.join(adapters)}]",
        "enable_lora: true",
        "max_lora_rank: 16",
        "max_loras: 2",
        f"max_model_len: {MAX_MODEL_LEN}",
        "max_num_seqs: 256",
        "gpu_memory_utilization: 0.9",
        "dtype: auto",
        f"port: {VLLM}",
        f"supervisor_port: {SUP}",
        "adapter_sync_s: 1",
        f"workdir: {work / 'serve'}",
        f"extra_vllm_args: [{', '.join(repr(a) for a in extra)}]",
    ]
    cfg.write_text("\n".join(lines) + "\n")
    return cfg


def start(cmd: list[str], env: dict[str, str], logf: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        cmd, env=env, stdout=logf.open("wb"), stderr=subprocess.STDOUT, start_new_session=True
    )


def stop(proc: subprocess.Popen[bytes], grace_s: float = 60) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def wait_ready(work: Path, t0: float, limit_s: float) -> dict[str, Any]:
    """Poll the supervisor until ready; vLLM's milestone lines with their seconds."""
    seen: list[dict[str, Any]] = []
    states: dict[str, float] = {}
    vlog = work / "serve" / "vllm.log"
    offset = 0
    status: dict[str, Any] = {}
    while time.monotonic() - t0 < limit_s:
        now = round(time.monotonic() - t0, 1)
        if vlog.exists():
            with vlog.open("rb") as f:
                f.seek(offset)
                chunk = f.read()
            cut = chunk.rfind(b"\n") + 1
            offset += cut
            for line in chunk[:cut].decode("utf-8", "replace").splitlines():
                if MILESTONES.search(line):
                    seen.append({"s": now, "line": line[-240:]})
        try:
            status = httpx.get(f"http://127.0.0.1:{SUP}/status", timeout=5).json()
            states.setdefault(status["state"], now)
            if status.get("ready"):
                return {
                    "ready_s": now,
                    "states_s": states,
                    "milestones": seen[-60:],
                    "status": status,
                }
            if status["state"] == "failed":
                break
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.5)
    return {"ready_s": None, "states_s": states, "milestones": seen[-60:], "status": status}


def wait_gateway(limit_s: float = 120, capacity: int | None = None) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        try:
            ready = httpx.get(f"http://127.0.0.1:{GW}/ready", timeout=5).status_code == 200
            if ready and (capacity is None or gateway_capacity() == capacity):
                return round(time.monotonic() - t0, 1)
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit("the gateway was not ready")


def gateway_capacity() -> float | None:
    text = httpx.get(f"http://127.0.0.1:{GW}/metrics", timeout=5).text
    m = re.search(r"^lorastack_gateway_backend_kv_capacity_tokens\{[^}]*\} (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


def vllm_metric(name: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{VLLM}/metrics", timeout=5).text
    total = 0.0
    for m in re.finditer(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", text, re.M):
        total += float(m.group(1))
    return total


# --- functional checks -------------------------------------------------------------------


def answer(r: httpx.Response, stream: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"status": r.status_code}
    if r.status_code != 200:
        out["error"] = r.text[:400]
    elif stream:
        events = [b[6:] for b in r.text.split("\n\n") if b.startswith("data: ")]
        out["events"] = len(events)
        out["done"] = bool(events) and events[-1] == "[DONE]"
        text = ""
        for e in events[:-1]:
            for c in json.loads(e).get("choices", []):
                text += (c.get("delta") or {}).get("content") or c.get("text") or ""
        out["text"] = text[:80]
    else:
        body = r.json()
        c = body["choices"][0]
        out["text"] = ((c.get("message") or {}).get("content") or c.get("text") or "")[:80]
        out["usage"] = body.get("usage")
    return out


def functional(adapter_name: str) -> dict[str, Any]:
    gw = f"http://127.0.0.1:{GW}"
    out: dict[str, Any] = {}
    with httpx.Client(timeout=120) as c:
        for model in (SERVED, adapter_name):
            for route in ("chat", "completions"):
                for stream in (False, True):
                    body: dict[str, Any] = {"model": model, "max_tokens": 16, "stream": stream}
                    if route == "chat":
                        body["messages"] = [{"role": "user", "content": "Say hello."}]
                        path = "/v1/chat/completions"
                    else:
                        body["prompt"] = "The capital of France is"
                        path = "/v1/completions"
                    r = c.post(gw + path, json=body)
                    out[f"{model} {route}{' stream' if stream else ''}"] = answer(r, stream)
        r = c.post(
            gw + "/v1/chat/completions",
            json={"model": SERVED, "max_tokens": MAX_MODEL_LEN + 1000,
                  "messages": [{"role": "user", "content": "Say hello."}]},
        )  # fmt: skip
        out["max_tokens over max_model_len"] = {"status": r.status_code, "body": r.json()}
        # an adapter declared at runtime through the supervisor's admin API, then served
        declared: dict[str, Any] = {}
        try:
            t0 = time.monotonic()
            r = c.post(f"http://127.0.0.1:{SUP}/admin/adapters", json={"ref": ADAPTER2})
            declared |= {"status": r.status_code, "body": r.json()}
            name = r.json().get("served_name") if r.status_code < 300 else None
            if name:
                while time.monotonic() - t0 < 60:
                    models = c.get(gw + "/v1/models").json()
                    if any(m["id"] == name for m in models.get("data", [])):
                        break
                    time.sleep(0.5)
                declared["listed_after_s"] = round(time.monotonic() - t0, 1)
                body = {
                    "model": name,
                    "max_tokens": 16,
                    "messages": [{"role": "user", "content": "Hi"}],
                }
                declared["chat"] = answer(c.post(gw + "/v1/chat/completions", json=body), False)
                body["stream"] = True
                declared["chat stream"] = answer(
                    c.post(gw + "/v1/chat/completions", json=body), True
                )
        except (httpx.HTTPError, ValueError, KeyError) as e:
            declared["error"] = f"{type(e).__name__}: {e}"
        out["runtime adapter"] = declared
    return out


# --- load ------------------------------------------------------------------------------


def client_processes(level: int) -> int:
    """Client processes for a level: one Python client kept a core busy from 16 streams on
    (4-5k tokens/s) and then measured itself (the same arm varied 35% between rounds); one
    process per 4 streams, at most 8 of the 16 cores (vLLM's API server and engine core and
    the gateway need theirs)."""
    return min(8, max(1, level // 4))


def _cpu_s(pid: int | None) -> float:
    """User + system CPU seconds so far of a process and its live children (the workers
    of `lorastack gateway --workers N`; 0 without a pid)."""
    if pid is None:
        return 0.0
    import psutil

    total = 0.0
    proc = psutil.Process(pid)
    for p in (proc, *proc.children(recursive=True)):
        with contextlib.suppress(psutil.NoSuchProcess):
            t = p.cpu_times()
            total += t.user + t.system
    return total


def _children_cpu() -> float:
    import resource

    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def _loadtest_cmd(url: str, streams: int, seed: int, requests: int, out: Path) -> list[str]:
    return [
        "lorastack", "loadtest", "--base-url", url, "--model", SERVED,
        "--concurrency", str(streams), "--requests", str(requests), "--warmup", "2",
        "--input-len", str(INPUT_LEN), "--output-len", str(OUTPUT_LEN), "--seed", str(seed),
        "--metrics-url", f"http://127.0.0.1:{VLLM}/metrics", "--out", str(out),
        "--processes", str(client_processes(streams)),
    ]  # fmt: skip


def _arm(out: Path, streams: int, wall: float, cpu: dict[str, float]) -> dict[str, Any]:
    """One arm's figures from its loadtest report."""
    lv = json.loads((out / "report.json").read_text())["levels"][0]
    server = lv.get("server") or {}
    return {
        "wall_s": round(wall, 1),
        # CPU seconds per wall second of the whole loadtest (warm-up included): a process
        # at ~1.0 is one saturated core, the relay's ceiling in one event loop
        "cpu_per_wall": {k: round(v / wall, 3) for k, v in cpu.items()},
        "streams": streams,
        "requests": lv["requests"], "completed": lv["completed"], "errors": lv["errors"],
        "error_examples": lv["error_examples"][:3],
        "ttft_ms": lv["ttft_ms"], "tpot_ms": lv["tpot_ms"], "itl_ms": lv["itl_ms"],
        "output_tokens_per_s": lv["output_tokens_per_s"], "duration_s": lv["duration_s"],
        "preemptions": server.get("preemptions"), "kv_peak": server.get("peak_kv_cache_usage"),
        "client_busy": lv.get("client_busy"), "client_processes": client_processes(streams),
    }  # fmt: skip


def loadtest(
    url: str,
    level: int,
    seed: int,
    work: Path,
    env: dict[str, str],
    requests: int,
    gateway_pid: int | None = None,
) -> dict[str, Any]:
    out = work / f"lt-{url.rsplit(':', 1)[1]}-{level}-{seed}"
    t0 = time.monotonic()
    client0 = _children_cpu()
    gateway0 = _cpu_s(gateway_pid)
    run(_loadtest_cmd(url, level, seed, requests, out), env, work / f"{out.name}.log")
    wall = time.monotonic() - t0
    cpu = {"client": _children_cpu() - client0}
    if gateway_pid is not None:
        cpu["gateway"] = _cpu_s(gateway_pid) - gateway0
    return _arm(out, level, wall, cpu)


def loadtest_paired(
    level: int, seeds: tuple[int, int], work: Path, env: dict[str, str], requests: int,
    gateway_pid: int,
) -> dict[str, Any]:  # fmt: skip
    """Both arms at once, each with half the level's streams (1 stream each at level 1), so
    they share vLLM's batches and whatever the engine's speed does meanwhile: between arms run
    one after the other vLLM's own speed moved by up to 40% (c5de625), more than the relay's
    cost; side by side only the relay's cost stays between them."""
    streams = max(1, level // 2)
    procs: dict[str, tuple[subprocess.Popen[bytes], Path]] = {}
    t0 = time.monotonic()
    gateway0 = _cpu_s(gateway_pid)
    for arm, port, seed in (("direct", VLLM, seeds[0]), ("gateway", GW, seeds[1])):
        out = work / f"lt-paired-{arm}-{level}-{seed}"
        logf = (work / f"{out.name}.log").open("w")
        cmd = _loadtest_cmd(f"http://127.0.0.1:{port}", streams, seed, requests, out)
        procs[arm] = (subprocess.Popen(cmd, env=env, stdout=logf, stderr=subprocess.STDOUT), out)
    walls: dict[str, float] = {}
    for arm, (proc, out) in procs.items():
        if proc.wait():
            raise SystemExit(f"paired loadtest {arm} failed: see {out.name}.log")
        walls[arm] = time.monotonic() - t0
    gateway_cpu = _cpu_s(gateway_pid) - gateway0
    return {
        "direct": _arm(procs["direct"][1], streams, walls["direct"], {}),
        "gateway": _arm(procs["gateway"][1], streams, walls["gateway"], {"gateway": gateway_cpu}),
    }


def compare(levels: dict[int, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per level: the gateway/direct output tokens/s of each round (rounds alternate which
    arm goes first), their median and range, and the added TTFT p50/p99 (medians)."""
    rows = []
    for level, rounds in levels.items():

        def ms(arm: dict[str, Any], q: str) -> float | None:
            v = (arm.get("ttft_ms") or {}).get(q)
            return v if isinstance(v, int | float) else None

        row: dict[str, Any] = {"streams": level, "rounds": len(rounds)}
        for q in ("p50", "p99"):
            added = [
                gv - dv
                for r in rounds
                if (dv := ms(r["direct"], q)) is not None
                and (gv := ms(r["gateway"], q)) is not None
            ]
            row[f"added_ttft_{q}_ms"] = round(statistics.median(added), 2) if added else None
        ratios = [
            r["gateway"]["output_tokens_per_s"] / r["direct"]["output_tokens_per_s"]
            for r in rounds
            if r["direct"]["output_tokens_per_s"]
        ]
        row["throughput_ratios"] = [round(x, 3) for x in ratios]
        row["throughput_ratio"] = round(statistics.median(ratios), 3) if ratios else None
        row["direct_tok_s"] = round(
            statistics.median(r["direct"]["output_tokens_per_s"] for r in rounds), 1
        )
        row["gateway_tok_s"] = round(
            statistics.median(r["gateway"]["output_tokens_per_s"] for r in rounds), 1
        )
        rows.append(row)
    return rows


async def pressure_arm(url: str, streams: int, seed: int, retry: bool) -> dict[str, Any]:
    """`streams` concurrent completions of INPUT_LEN random token ids + OUTPUT_LEN tokens;
    with `retry`, a 429 waits its Retry-After (capped at 5 s) and tries again, as the
    openai SDK does. Preemptions and KV usage read from vLLM's /metrics around it."""
    rng = random.Random(seed)
    before = vllm_metric("vllm:num_preemptions_total")
    statuses: dict[str, int] = {}
    tokens = 0
    kv_peak = 0.0
    done = asyncio.Event()

    async def sample() -> None:
        nonlocal kv_peak
        async with httpx.AsyncClient(timeout=5) as c:
            while not done.is_set():
                text = (await c.get(f"http://127.0.0.1:{VLLM}/metrics")).text
                m = re.search(r"^vllm:kv_cache_usage_perc\{[^}]*\} (\S+)$", text, re.M)
                if m:
                    kv_peak = max(kv_peak, float(m.group(1)))
                await asyncio.sleep(0.1)

    async def one(client: httpx.AsyncClient, prompt: list[int]) -> None:
        nonlocal tokens
        body = {"model": SERVED, "prompt": prompt, "max_tokens": OUTPUT_LEN, "stream": True,
                "ignore_eos": True, "stream_options": {"include_usage": True}}  # fmt: skip
        while True:
            async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
                key = str(r.status_code)
                statuses[key] = statuses.get(key, 0) + 1
                if r.status_code == 429 and retry:
                    await r.aread()
                    await asyncio.sleep(min(5.0, float(r.headers.get("retry-after", "1"))))
                    continue
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        usage = json.loads(line[6:]).get("usage")
                        if usage:
                            tokens += usage["completion_tokens"]
                return

    prompts = [[rng.randrange(100, 49000) for _ in range(INPUT_LEN)] for _ in range(streams)]
    sampler = asyncio.create_task(sample())
    t0 = time.monotonic()
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=1000)) as c:
        await asyncio.gather(*(one(c, p) for p in prompts))
    wall = time.monotonic() - t0
    done.set()
    await sampler
    return {
        "streams": streams, "wall_s": round(wall, 2), "statuses": statuses,
        "output_tokens": tokens, "goodput_tok_s": round(tokens / wall, 1),
        "preemptions": vllm_metric("vllm:num_preemptions_total") - before,
        "kv_peak": kv_peak,
    }  # fmt: skip


# --- the whole check ---------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", type=Path, required=True)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--work", type=Path, default=Path("/tmp/serve-bench"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--skip-load", action="store_true")
    ap.add_argument("--skip-functional", action="store_true", help="no step 3")
    ap.add_argument("--skip-pressure", action="store_true", help="end after step 4")
    ap.add_argument(
        "--rounds", type=int, default=3, help="load rounds per level, the first arm alternating"
    )
    ap.add_argument("--only-pressure", action="store_true", help="publish, then step 5 alone")
    ap.add_argument(
        "--levels", default=",".join(map(str, LEVELS)), help="streams of step 4, e.g. 16"
    )
    ap.add_argument("--requests", type=int, help="requests per arm at every level of step 4")
    ap.add_argument(
        "--paired", action="store_true",
        help="step 4 runs both arms at once, half the streams each (loadtest_paired)",
    )  # fmt: skip
    args = ap.parse_args()
    work: Path = args.work
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    env = dict(os.environ, LORASTACK_HOME=str(work / "home"), PYTHONUNBUFFERED="1")
    env.pop("VLLM_USE_FLASHINFER_SAMPLER", None)  # the supervisor decides (and says so)
    result: dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}

    def save() -> None:
        args.out.write_text(json.dumps(result, indent=2, default=str) + "\n")

    procs: list[subprocess.Popen[bytes]] = []
    try:
        import torch
        import vllm

        result["versions"] = {"vllm": vllm.__version__, "torch": torch.__version__,
                              "gpu": torch.cuda.get_device_name(0)}  # fmt: skip
        log(f"versions {result['versions']}")
        result["model"] = make_model(args.tokenizer, args.layers, work)
        result["publish"] = publish(work, env)
        log(f"model and adapters published: {result['publish']}")
        save()

        serve = gateway = None
        if not args.only_pressure:
            # 1-2: cold start, KV estimate vs vLLM
            t0 = time.monotonic()
            serve = start(["lorastack", "serve", str(serve_config(work, "serve", [], [ADAPTER]))],
                          env, work / "serve.log")  # fmt: skip
            procs.append(serve)
            ready = wait_ready(work, t0, 480)
            status = ready.pop("status")
            result["cold_start"] = ready
            result["kv_cache"] = status.get("kv_cache")
            result["supervisor_status"] = {
                k: status.get(k)
                for k in ("state", "restarts", "last_error", "root_cause", "adapters")
            }
            log(
                f"ready after {ready['ready_s']} s; KV {result['kv_cache'] and result['kv_cache'].get('difference_pct')}%"
            )
            save()
            if ready["ready_s"] is None:
                raise SystemExit("vLLM never became ready")
            adapter_name = status["adapters"][0]["served_name"]

            gw_env = dict(env, LORASTACK_BACKENDS=f"http://127.0.0.1:{VLLM}")
            gateway = start(
                ["lorastack", "gateway", "--port", str(GW)], gw_env, work / "gateway.log"
            )
            procs.append(gateway)
            result["gateway_ready_s"] = wait_gateway()

            # 3: what a client does
            if not args.skip_functional:
                result["functional"] = functional(adapter_name)
                log("functional checks done")
                save()

            # 4: direct vs gateway
            if not args.skip_load:
                levels: dict[int, list[dict[str, Any]]] = {}
                for level in [int(x) for x in args.levels.split(",")]:
                    levels[level] = []
                    for i in range(args.rounds):
                        requests = args.requests or REQUESTS[level]
                        if args.paired:
                            seeds = (1000 + 10 * level + i, 2000 + 10 * level + i)
                            arms = {"first": "both"} | loadtest_paired(
                                level, seeds, work, env, requests, gateway.pid
                            )
                            log(
                                f"{level} streams paired, round {i + 1}: direct "
                                f"{arms['direct']['output_tokens_per_s']:.0f}, gateway "
                                f"{arms['gateway']['output_tokens_per_s']:.0f} tok/s"
                            )
                            levels[level].append(arms)
                            result["load"] = {
                                "paired": True, "levels": levels, "comparison": compare(levels)
                            }  # fmt: skip
                            save()
                            continue
                        order = ("direct", "gateway") if i % 2 == 0 else ("gateway", "direct")
                        arms = {"first": order[0]}
                        for arm in order:
                            url = f"http://127.0.0.1:{VLLM if arm == 'direct' else GW}"
                            # no prompt shared between arms or rounds: prefix caching favours none
                            seed = (1000 if arm == "direct" else 2000) + 10 * level + i
                            gw_pid = gateway.pid if arm == "gateway" else None
                            arms[arm] = loadtest(url, level, seed, work, env, requests, gw_pid)
                            tok_s = arms[arm]["output_tokens_per_s"]
                            log(f"{level} streams, round {i + 1}, {arm}: {tok_s:.0f} tok/s")
                        levels[level].append(arms)
                        result["load"] = {"levels": levels, "comparison": compare(levels)}
                        save()

        # 5: pressure
        if args.skip_pressure:
            return 0
        if serve is not None:
            stop(serve)
        t0 = time.monotonic()
        serve = start(
            ["lorastack", "serve",
             str(serve_config(work, "pressure", ["--num-gpu-blocks-override", "512"], []))],
            env, work / "serve-pressure.log",
        )  # fmt: skip
        procs.append(serve)
        ready = wait_ready(work, t0, 300)
        status = ready.pop("status")
        pressure: dict[str, Any] = {"ready_s": ready["ready_s"], "kv_cache": status.get("kv_cache")}
        result["pressure"] = pressure
        save()
        if gateway is None:
            gw_env = dict(env, LORASTACK_BACKENDS=f"http://127.0.0.1:{VLLM}")
            gateway = start(
                ["lorastack", "gateway", "--port", str(GW)], gw_env, work / "gateway.log"
            )
            procs.append(gateway)
        wait_gateway(120, capacity=512 * 16)
        pressure["gateway_capacity_tokens"] = gateway_capacity()
        pressure["direct"] = asyncio.run(pressure_arm(f"http://127.0.0.1:{VLLM}", 64, 7, False))
        log(f"pressure direct: {pressure['direct']}")
        pressure["gateway"] = asyncio.run(pressure_arm(f"http://127.0.0.1:{GW}", 64, 8, True))
        log(f"pressure gateway: {pressure['gateway']}")
        save()
    finally:
        for p in reversed(procs):
            stop(p, 30)
        for name in ("serve.log", "gateway.log", "serve-pressure.log"):
            if (work / name).exists():
                shutil.copy(work / name, args.out.parent / name)
        vlog = work / "serve" / "vllm.previous.log"
        if vlog.exists():
            shutil.copy(vlog, args.out.parent / "vllm-first.log")
        result["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
