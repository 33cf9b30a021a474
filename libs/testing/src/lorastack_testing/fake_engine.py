"""A stand-in for the inference supervisor's vLLM process (`inference.engine.VllmServer`):
the one fake vLLM, started in a thread on the port the supervisor asks for.

Pass the class as the supervisor's `server_factory`. It takes the same spec
(`inference.engine.EngineSpec`, read through the `Spec` protocol: this layer imports no
service) and reads what it needs: the served model and `lora_modules` become the fake's
`/v1/models`, as `--served-model-name` and `--lora-modules` would; runtime LoRA
loads go through the fake's `/v1/load_lora_adapter`. Every start is a fresh server whose
state is in `FakeEngine.started` (newest last), so a test can look at what vLLM would
serve now, or `kill()` one to make the supervisor restart.

`publish_tiny_model` and `publish_tiny_adapter` put a few-byte base model (config.json
only) and adapters for it in a store: enough for the supervisor's checks (kind, base,
rank, KV estimate), nothing a real vLLM could load.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, Protocol

from lorastack.manifest import Manifest
from lorastack.store import ArtifactStore
from lorastack_testing.fake_vllm import FakeServer, FakeState

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 128, "max_position_embeddings": 2048,
}  # fmt: skip


def publish_tiny_model(store: ArtifactStore, folder: Path, name: str = "tiny") -> Manifest:
    """Publish a base model that is only a config.json (TINY_LLAMA) as `name`."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(TINY_LLAMA))
    return store.publish(folder, kind="base-model", name=name, service="test")


def publish_tiny_adapter(
    store: ArtifactStore, folder: Path, base: Manifest | None, *, name: str, rank: int = 8
) -> Manifest:
    """An adapter of `base` whose bytes differ per `folder` (so each is new content), with
    the training record `lorastack eval --adapter` reads."""
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps({"r": rank, "id": folder.name}))
    (folder / "adapter_model.safetensors").write_bytes(folder.name.encode())
    (folder / "training-complete.json").write_text(json.dumps({"train_loss": 0.2}))
    return store.publish(
        folder, kind="adapter", name=name, service="test",
        parents=[base.as_parent("base")] if base else [],
    )  # fmt: skip


class Spec(Protocol):
    """What the fake reads of an `inference.engine.EngineSpec`."""

    @property
    def served_name(self) -> str: ...
    @property
    def port(self) -> int: ...
    @property
    def max_model_len(self) -> int: ...
    @property
    def lora_modules(self) -> Mapping[str, Path]: ...
    @property
    def workdir(self) -> Path: ...


class FakeEngine:
    """The fake vLLM as the supervisor's `server_factory`: serves the spec's model and
    `lora_modules` from a thread on its `port`."""

    started: ClassVar[list[FakeEngine]] = []  # every engine started, newest last

    def __init__(self, spec: Spec) -> None:
        name = spec.served_name
        models: list[dict[str, Any]] = [{"id": name, "max_model_len": spec.max_model_len}]
        models += [
            {"id": lora, "root": str(path), "parent": name}
            for lora, path in spec.lora_modules.items()
        ]
        self.state = FakeState(models=models)
        self.port = spec.port
        self.log_path = Path(spec.workdir) / "vllm.log"
        self.returncode: int | None = None
        self._server: FakeServer | None = None
        self._stopped = threading.Event()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return None

    @property
    def running(self) -> bool:
        return self._server is not None and not self._stopped.is_set()

    def start(self) -> None:
        """Start the fake server and add this engine to `started`."""
        self._server = FakeServer(self.state, port=self.port).__enter__()
        FakeEngine.started.append(self)

    def wait_ready(self, timeout_s: float = 0.0, cancel: threading.Event | None = None) -> None:
        """Up as soon as it started."""

    def kill(self) -> None:
        """Stop the server (`stop`): the fake has no process to kill."""
        self.stop()

    def stop(self, grace_s: float = 0.0) -> int | None:
        """Stop the server (once); returns the exit code (0), or None if never started."""
        if self._server is not None and not self._stopped.is_set():
            self._stopped.set()
            self._server.__exit__(None, None, None)
            self.returncode = 0
        return self.returncode

    def log_tail(self, n: int = 50) -> str:
        """The log's last lines: none, the fake writes no log."""
        return ""

    def read_log(self) -> str:
        """The log: empty, the fake writes none."""
        return ""
