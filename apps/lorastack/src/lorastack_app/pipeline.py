"""`lorastack demo`: the main job on the embedded defaults, stage by stage.

Every stage is a `lorastack` command run as a child process, printed before it runs, so
each step can be repeated by hand and shows its own progress. In order: import the
base model, write the demo task (written dates -> ISO dates) and check it; start vLLM on
the base model and the gateway (`lorastack up`) beside the smoke test and the training;
load the trained adapter into the running vLLM (`POST /admin/adapters`: parity-checked
under a private name before any client can reach it) while the merge and its
verification run beside serving; chat through the gateway (multi-turn and streaming),
show base and LoRA answers side by side, evaluate base + prompt vs LoRA on the frozen
test split, run a short load test, and print where everything is. A stage started
"beside" the others runs as its own process with its own log; the demo waits for it
where its result is needed and fails with its log's tail if it failed. A demo run left by
other code or another config is started afresh (lorastack_app.earlier_run); one this code
made is continued.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path
from typing import Any

import httpx
import yaml

from inference.engine import detect_platform
from lorastack.errors import NotFound, Refused
from lorastack.settings import CommonSettings
from lorastack.sse import EventReader, chunk_text
from lorastack.store import open_store
from lorastack_app.local_stack import (
    GATEWAY_PORT,
    SUPERVISOR_PORT,
    VLLM_PORT,
    parity_lines,
    services,
    tail,
    wait_listed,
)
from trainer.config import load_config
from trainer.settings import TrainerSettings

RUN = "date-iso"  # artifact prefix of the demo run
BASE = "smollm2-135m-instruct"
SERVED_BASE = "smollm2"
SYSTEM_PROMPT = "Convert the date to ISO 8601 (YYYY-MM-DD). Answer with the date only."
FEW_SHOT = ["the fourth of July, 1999 => 1999-07-04", "March 3rd 2021 => 2021-03-03"]


@dataclass
class Beside:
    """A stage running as its own process beside the next ones (`Stages.start`)."""

    title: str
    cmd: list[str]
    proc: subprocess.Popen[bytes]
    log: Path
    started: float


class Stages:
    """Runs and times the stages; a failing command stops the demo with its exit code."""

    def __init__(self) -> None:
        self.timings: dict[str, float] = {}
        self.started = time.monotonic()
        self.beside: list[Beside] = []

    def run(self, title: str, *args: str, ok: tuple[int, ...] = (0,)) -> None:
        """Run `lorastack ARGS` as a stage and time it; raises Refused on an exit code not in
        `ok`."""
        cmd = ["lorastack", *args]
        print(f"\n== {title}\n$ {' '.join(cmd)}", flush=True)
        start = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "lorastack.cli", *args], check=False)
        self.timings[title] = time.monotonic() - start
        if proc.returncode not in ok:
            raise Refused(
                f"stage '{title}' failed (exit code {proc.returncode})",
                f"re-run it alone: {' '.join(cmd)}",
            )
        print(f"   ({self.timings[title]:.0f} s)", flush=True)

    def start(self, title: str, log: Path, *args: str) -> Beside:
        """Start `lorastack ARGS` beside the next stages, its output to `log`; `finish`
        waits for it."""
        cmd = ["lorastack", *args]
        print(f"\n== {title} (beside the next stages; log: {log})\n$ {' '.join(cmd)}", flush=True)
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "lorastack.cli", *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        stage = Beside(title, cmd, proc, log, time.monotonic())
        self.beside.append(stage)
        return stage

    def finish(self, stage: Beside) -> None:
        """Wait for a stage started beside the others; Refused, with its log's tail, when
        it failed. Its time is from its start to its end, most of it hidden by the others."""
        waited = time.monotonic()
        code = stage.proc.wait()
        self.beside.remove(stage)
        end = time.monotonic()
        self.timings[f"{stage.title} (beside)"] = end - stage.started
        if code != 0:
            raise Refused(
                f"stage '{stage.title}' failed (exit code {code}):\n{tail(stage.log)}",
                f"the full log is {stage.log}; re-run it alone: {' '.join(stage.cmd)}",
            )
        print(
            f"\n== {stage.title}: done ({end - stage.started:.0f} s,"
            f" {end - waited:.0f} s of it waited for)",
            flush=True,
        )

    def stop_beside(self) -> None:
        """Stop what still runs beside (the demo failed before it waited for it)."""
        for stage in self.beside:
            stage.proc.terminate()
            stage.proc.wait()
        self.beside.clear()

    @contextlib.contextmanager
    def timed(self, title: str) -> Iterator[None]:
        """Time an in-process stage (one that is no `lorastack` command)."""
        print(f"\n== {title}", flush=True)
        start = time.monotonic()
        yield
        self.timings[title] = time.monotonic() - start
        print(f"   ({self.timings[title]:.0f} s)", flush=True)


def demo_config() -> Path:
    """The demo job's trainer config: package data of the trainer (any install, not only
    an editable checkout)."""
    resource = files("trainer") / "configs" / "demo.yaml"
    if not resource.is_file():
        raise NotFound(f"{resource} is missing", "reinstall the trainer service (make setup)")
    return Path(str(resource))


def write_serve_config(path: Path, platform: str) -> None:
    """The demo's serve.yaml: the base model with LoRA on and no adapter yet (the demo
    loads the trained one at runtime). On CUDA vLLM runs eager: CUDA graphs and
    torch.compile cost a 135M model more start-up time than the demo's few requests win
    back; and its KV cache has a fixed size (1 GiB, as on the CPU): it starts beside the
    training, whose memory vLLM's start-up profile would otherwise take for its own."""
    config: dict[str, Any] = {
        "model": BASE,
        "served_model_name": SERVED_BASE,
        "enable_lora": True,
        "max_model_len": 2048,
        "max_num_seqs": 8,
        "kv_cache_gib": 1,
        "max_lora_rank": 16,
        "max_loras": 2,
    }
    if platform == "cuda":
        config["extra_vllm_args"] = ["--enforce-eager"]
        config["gpu_kv_cache_gib"] = 1
    path.write_text(yaml.safe_dump(config, sort_keys=False))


def chat(gateway: str, model: str, messages: list[dict[str, str]], max_tokens: int = 48) -> str:
    """The answer of `model` to `messages` through the gateway, at temperature 0."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    r = httpx.post(f"{gateway}/v1/chat/completions", json=body, timeout=120)
    r.raise_for_status()
    return str(r.json()["choices"][0]["message"]["content"])


def stream_chat(gateway: str, model: str, messages: list[dict[str, str]]) -> Iterator[str]:
    """The streamed answer of `model` to `messages` through the gateway, piece by piece."""
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": 48,
        "temperature": 0,
        "stream": True,
    }
    with httpx.stream("POST", f"{gateway}/v1/chat/completions", json=body, timeout=120) as r:
        r.raise_for_status()
        reader = EventReader()
        for raw in r.iter_bytes():
            for event in reader.feed(raw):
                if piece := chunk_text(event):
                    yield piece


def load_adapter(supervisor: str, ref: str, digest: str) -> str:
    """Have the running supervisor serve the adapter `ref` (`POST /admin/adapters`): it
    replays the adapter's parity reference under a private name no client can reach, and
    serves it under its name only when the verdict passes. Returns the served name; one
    already served (an earlier demo's declaration, loaded at start) is not loaded twice.
    Refused with the supervisor's cause when it refuses."""
    status = httpx.get(f"{supervisor}/status", timeout=30).json()
    for served in status.get("adapters", []):
        if (served["ref"], served["digest"]) == (ref, digest):
            print(f"   {served['served_name']} is served already (loaded at start)")
            return str(served["served_name"])
    print(f'$ curl -X POST {supervisor}/admin/adapters -d \'{{"ref": "{ref}"}}\'', flush=True)
    # the check replays every probe (parity_timeout_s, 300 s, at most), then vLLM loads it
    resp = httpx.post(f"{supervisor}/admin/adapters", json={"ref": ref}, timeout=900)
    if resp.status_code != 201:
        error = resp.json().get("error", {}) if resp.content else {}
        raise Refused(
            f"the supervisor did not serve {ref} ({resp.status_code}):"
            f" {error.get('message', resp.text)}",
            error.get("hint") or "see 'lorastack status' and HOME/logs/inference.log",
        )
    return str(resp.json()["served_name"])


def test_prompts(settings: CommonSettings, n: int) -> list[tuple[str, str]]:
    """The first `n` (user prompt, expected answer) pairs of the demo's test split."""
    store = open_store(settings)
    folder = store.fetch(store.resolve(f"{RUN}/test"))
    out = []
    for line in (folder / "test.jsonl").read_text().splitlines()[:n]:
        msgs = json.loads(line)["messages"]
        user = next(m["content"] for m in reversed(msgs) if m["role"] == "user")
        out.append((user, msgs[-1]["content"]))
    return out


def run_demo(settings: TrainerSettings, max_steps: int | None, keep_running: bool) -> int:
    """The demo end to end: import, data, smoke test, train, merge, serve, chat, evaluate and
    load-test; stops the services unless `keep_running`. Returns the exit code."""
    stages = Stages()
    work = settings.home / "demo"
    work.mkdir(parents=True, exist_ok=True)
    data = work / "demo-dates.jsonl"
    config = demo_config()
    overrides = [f"dataset.path={data}"] + ([f"max_steps={max_steps}"] if max_steps else [])
    gateway = f"http://127.0.0.1:{GATEWAY_PORT}"

    stages.run("import the default base model", "model", "import-default")
    stages.run("write the demo task (written date -> ISO date)", "data", "make-demo", str(data))
    # exit 1 = warnings only: the data can be trained on
    stages.run("check the dataset", "data", "check", str(config), *overrides, ok=(0, 1))
    # a second demo continues the first run's checkpoints (or, finished, re-publishes it);
    # a run that other code or another config left starts afresh (before the smoke test:
    # the run's folder holds the smoke run's step time, which the training estimate reads)
    from lorastack_app.earlier_run import continue_or_restart  # torch: the demo's alone

    again = continue_or_restart(
        open_store(settings), settings.resolved_runs_dir, load_config(config, overrides)
    )
    # vLLM and the gateway serve the base model, the adapter joins them at runtime. On a GPU
    # they start beside the smoke test and the training, and the merge runs beside serving;
    # on the CPU every stage runs alone: side by side they share two cores and each waits on
    # the other's threads (measured on 2 idle cores: 523 s in all, against ~250 in turn)
    platform = detect_platform()
    beside = platform == "cuda"
    serve_yaml = work / "serve.yaml"
    write_serve_config(serve_yaml, platform)
    up = ("start vLLM on the base model and the gateway", "up", "--serve-config", str(serve_yaml))
    merge = ("merge into the base and verify", "merge", f"{RUN}/adapter", "--dtype", "float32")
    serving = stages.start(up[0], work / "up.log", *up[1:]) if beside else None
    merging = None
    try:
        # the smoke test's checks (the loss falls, the checkpoint reloads, a sample stops) on
        # 2 samples a step instead of the run's 8, a quarter of the compute; the run's cost
        # estimate scales its time per token
        smoke_batch = ["micro_batch=2", "grad_accum=1"]
        stages.run("smoke test", "train", str(config), "--smoke", *overrides, *smoke_batch)
        stages.run("train", "train", str(config), *overrides, *again)
        if serving is not None:
            merging = stages.start(merge[0], work / "merge.log", *merge[1:])
            stages.finish(serving)
        else:
            stages.run(*merge)
            stages.run(*up)
        adapter = open_store(settings).resolve(f"{RUN}/adapter")
        with stages.timed("serve the adapter: parity check, then load (POST /admin/adapters)"):
            supervisor = f"http://127.0.0.1:{SUPERVISOR_PORT}"
            lora = load_adapter(supervisor, adapter.ref, adapter.digest)
            wait_listed(services(settings, serve_yaml, GATEWAY_PORT))
            for line in parity_lines(supervisor):
                print(f"   {line}")
        base = SERVED_BASE
        with stages.timed("chat through the gateway"):
            turns = [{"role": "user", "content": "Convert to ISO 8601: the ninth of May, 2013"}]
            first = chat(gateway, lora, turns)
            turns += [
                {"role": "assistant", "content": first},
                {"role": "user", "content": "And: December 25th, 1990"},
            ]
            print(f"   multi-turn ({lora}): {first!r} then {chat(gateway, lora, turns)!r}")
            print(f"   streaming ({base}): ", end="", flush=True)
            for piece in stream_chat(
                gateway, base, [{"role": "user", "content": "Say hello in five words."}]
            ):
                print(piece, end="", flush=True)
            print()
        with stages.timed("base and LoRA side by side (frozen test split)"):
            print(f"   {'prompt':44} {'expected':11} {'base + prompt':22} LoRA")
            for user, expected in test_prompts(settings, 5):
                b = chat(
                    gateway,
                    base,
                    [
                        {"role": "system", "content": SYSTEM_PROMPT},
                        {"role": "user", "content": user},
                    ],
                    16,
                )
                lo = chat(gateway, lora, [{"role": "user", "content": user}], 16)
                b, lo = " ".join(b.split()), " ".join(lo.split())  # one line per row
                print(f"   {user[:44]:44} {expected:11} {b[:22]:22} {lo[:22]}")
        eval_args = [
            "eval",
            "--base-url",
            gateway,
            "--test",
            f"{RUN}/test",
            "--base-model",
            base,
            "--lora-model",
            lora,
            "--system-prompt",
            SYSTEM_PROMPT,
            "--adapter",
            adapter.ref,
            "--max-tokens",
            "24",
            "--out",
            str(work / "eval"),
        ]
        for shot in FEW_SHOT:
            eval_args += ["--few-shot", shot]
        stages.run("evaluate base + prompt vs LoRA", *eval_args)
        base_dir = open_store(settings).fetch(open_store(settings).resolve(BASE))
        stages.run(
            "short load test through the gateway",
            "loadtest",
            "--base-url",
            gateway,
            "--model",
            lora,
            "--concurrency",
            "1,4",
            "--requests",  # a look at the table, not a measurement: ~15 s on 2 cores
            "4",
            "--input-len",
            "64",
            "--output-len",
            "16",
            "--tokenizer",
            str(base_dir),
            "--metrics-url",
            f"http://127.0.0.1:{VLLM_PORT}/metrics",
            "--out",
            str(work / "loadtest"),
        )
        if merging is not None:
            stages.finish(merging)
    finally:
        stages.stop_beside()  # only what a failed stage left running
        if not keep_running:
            stages.run("stop the services", "down")
    summary(settings, stages, work, keep_running)
    return 0


def summary(settings: CommonSettings, stages: Stages, work: Path, running: bool) -> None:
    """Print where the demo's artifacts, reports and (while running) services are."""
    store = open_store(settings)
    print(f"\n== where everything is\nstore: {store.url}")
    for m in store.ls():
        print(f"   {m.ref:34} {m.kind:13} {m.digest[7:19]}")
    runs = (
        sorted((settings.home / "runs").glob(f"{RUN}*"))
        if (settings.home / "runs").is_dir()
        else []
    )
    for run in runs[-1:]:
        print(f"run folder: {run}")
        for name in ("training-complete.json", "loss.png", "memory-estimate.json"):
            if (run / name).exists():
                print(f"   {run / name}")
    print(f"eval report: {work / 'eval' / 'report.md'}")
    print(
        f"promote: .venv/bin/lorastack promote {RUN}/adapter (moves {RUN}/adapter@promoted"
        " only when that evaluation says improvement; serve.yaml may then name it)"
    )
    print(f"load test: {work / 'loadtest'}")
    if running:
        print(f"gateway: http://127.0.0.1:{GATEWAY_PORT}/v1 (metrics: /metrics)")
        print(
            f"vLLM: http://127.0.0.1:{VLLM_PORT}/v1, supervisor: "
            f"http://127.0.0.1:{SUPERVISOR_PORT}/status"
        )
        print("stop the services with: .venv/bin/lorastack down")
    print("\n== timings (s)")
    for k, v in stages.timings.items():
        print(f"   {v:7.0f}  {k}")
    print(f"   {time.monotonic() - stages.started:7.0f}  total (wall clock, start to here)")


def cmd_demo(args: argparse.Namespace) -> int:
    return run_demo(TrainerSettings(), args.max_steps, keep_running=not args.stop)


def register(sub: Any) -> None:
    p = sub.add_parser("demo", help="run the main job on the embedded defaults")
    p.add_argument("--max-steps", type=int, help="stop training after N optimizer steps")
    p.add_argument("--stop", action="store_true", help="stop vLLM and the gateway at the end")
    p.set_defaults(handler=cmd_demo)
