"""Keeps one vLLM alive and explains it: start, warm-up, readiness, restarts, adapters.

Owns the state machine and the adapter registry; it does not know HTTP routes (main.py)
or metric names (metrics.py). One background thread runs the loop:

    starting -> warming -> ready --(vLLM exits)--> restarting --(backoff)--> starting ...
                       `-> refused (the served model contradicts its parity reference)
    any --(SIGTERM)--> draining (not ready; vLLM's open requests end) -> stopping -> stopped

`ready` is true only after vLLM answered /v1/models AND a warm-up completion AND what it
serves passed its parity check (inference.parity: the reference recorded where the model
was trained, replayed through vLLM). A model that fails, or whose check cannot run, stops
vLLM and leaves the supervisor `refused` (under `parity: refuse` or `auto`), never ready.
No client reaches an adapter before its verdict: each adapter, at start as at runtime, is
loaded under a private name (lorastack.parity.CHECK_PREFIX, which the gateway never lists),
checked there, and only then loaded under its served name; one refused, or whose check
failed, is unloaded and the call answers 409 with the cause. When vLLM
exits, ready goes false at once, its last log lines are kept with the engine's root cause
(the first exception of vLLM's engine process, `engine_log.py`: the API server's own
traceback only says "see root cause above"), and it is started again after
min(restart_backoff_max_s, restart_backoff_s × 2^(failures−1)) seconds; the failure count
resets once a start reaches ready. `max_identical_failures` starts in a row that die of
the same cause end the loop (state `failed`): restarting cannot fix a missing module.
Adapters loaded at runtime are loaded again (and checked again) after a restart.

The exit record and the restart rules are restarts.py; the KV-cache comparison it logs
and reports is kv_report.py; the /status body is status_report.py.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from inference import parity, vllm_api
from inference.artifacts import ServedAdapter, ServedModel, fetch_adapter
from inference.chat_format import ChatFormat, check_adapter, vllm_flags
from inference.engine import EngineSpec, Platform, VllmServer
from inference.errors import EngineFailed
from inference.kv_cache import KvEstimate
from inference.kv_report import KvFigures
from inference.restarts import RestartHistory, backoff_delay
from inference.settings import InferenceSettings
from inference.status_report import ModelStatus, RootCauseStatus, SupervisorStatus, VllmStatus
from lorastack.errors import Conflict, NotFound, Refused
from lorastack.manifest import validate_name
from lorastack.parity import CHECK_PREFIX, REFERENCE_FILE
from lorastack.store import ArtifactStore

log = logging.getLogger(__name__)


@dataclass
class ServePlan:
    """Everything fetched and computed before vLLM starts."""

    model: ServedModel
    adapters: list[ServedAdapter]
    estimate: KvEstimate
    platform: Platform
    chat: ChatFormat  # chat template and tool parser (inference.chat_format)
    dtype: str = "float32"  # what vLLM computes in (lorastack.parity.serving_dtype)
    dtype_reason: str = ""  # why, said at start and on /status


class Supervisor:
    """Keeps one vLLM alive: start, warm-up, readiness, restarts, adapters (module docstring)."""

    def __init__(
        self,
        settings: InferenceSettings,
        plan: ServePlan,
        store: ArtifactStore,
        *,
        server_factory: Callable[[EngineSpec], VllmServer] = VllmServer,
    ) -> None:
        self.settings = settings
        self.plan = plan
        self.store = store
        self._factory = server_factory
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._draining = threading.Event()  # shutting down: never ready again
        self._thread: threading.Thread | None = None
        self._adapters: dict[str, ServedAdapter] = {a.served_name: a for a in plan.adapters}
        self.server: VllmServer | None = None
        self.state = "created"
        self.ready = False
        self.history = RestartHistory()  # restarts, failed starts, exits, root cause
        self.started_at = 0.0  # unix time of the current start
        self.last_error = ""
        self.kv = KvFigures(plan.estimate)  # the estimate and what vLLM reported
        self.parity = parity.ParityChecks(
            settings.parity,
            served_dtype=plan.dtype,
            api_key=self._vllm_key,
            served_quantization=parity.served_quantization(settings.extra_vllm_args),
            max_model_len=settings.max_model_len,
            timeout_s=settings.parity_request_timeout_s,
            deadline_s=settings.parity_timeout_s,
        )

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        """Start the supervisor's loop (start vLLM, restart it when it exits) in a thread."""
        self._thread = threading.Thread(target=self._run, name="vllm-supervisor", daemon=True)
        self._thread.start()

    def drain(self, timeout_s: float, poll_s: float = 0.2) -> bool:
        """Not ready any more (state `draining`: the readiness probe fails and the headless
        Service stops listing this replica), then wait until vLLM runs and queues nothing,
        at most `timeout_s` seconds. True when it emptied (or no vLLM runs)."""
        with self._lock:
            self._draining.set()
            self.ready = False
            self.state = "draining"
            server = self.server
        if server is None or not server.running:
            return True
        if busy := vllm_api.wait_idle(server.base_url, timeout_s, poll_s):
            log.warning("drain: %d request(s) still open after %.0f s; stopping", busy, timeout_s)
            return False
        log.info("drain: no request open; stopping vLLM")
        return True

    def stop(self) -> None:
        """Stop the loop and vLLM, and wait for them."""
        self._stop.set()
        with self._lock:
            self.ready = False
            self.state = "stopping"
            server = self.server
        if server is not None:
            server.stop()
        if self._thread is not None:
            self._thread.join(timeout=60)
        with self._lock:
            server = self.server
        if server is not None:  # the loop may have started another one meanwhile
            server.stop()
        self.state = "stopped"

    def _new_server(self) -> VllmServer:
        spec = EngineSpec.from_settings(
            self.settings,
            model_dir=self.plan.model.path,
            dtype=self.plan.dtype,
            platform=self.plan.platform,
            extra_args=self.engine_args,
        )
        return self._factory(spec)

    @property
    def _vllm_key(self) -> str | None:
        """vLLM's --api-key: runtime adapters load only through this supervisor."""
        key = self.settings.vllm_api_key
        return key.get_secret_value() if key is not None else None

    @property
    def engine_args(self) -> list[str]:
        """Extra vLLM arguments: the configured ones, the chat format's and the KV-cache dtype."""
        args = list(self.settings.extra_vllm_args)
        args += vllm_flags(self.plan.chat, args)  # template and tool parser the artifacts need
        if self.settings.kv_cache_dtype != "auto":
            args += ["--kv-cache-dtype", self.settings.kv_cache_dtype]
        return args

    def _run(self) -> None:
        while not self._stop.is_set():
            server = self._new_server()
            with self._lock:
                self.server = server
                self.state = "starting"
                self.started_at = time.time()
            try:
                server.start()
                server.wait_ready(self.settings.startup_timeout_s, cancel=self._stop)
                with self._lock:
                    self.state = "warming"
                vllm_api.warm_up(
                    server.base_url, self.settings.resolved_served_name, api_key=self._vllm_key
                )
                self.kv.read(server.read_log(), vllm_api.get_metrics(server.base_url))
                checked = self._check_served_parity(server)
                with self._lock:
                    if self._stop.is_set() or self._draining.is_set():
                        break
                    self.history.reached_ready()
                    if checked.serve:
                        self.ready, self.state, self.last_error = True, "ready", ""
                    else:
                        self.state, self.last_error = "refused", checked.reason
                if not checked.serve:  # fail closed: nothing served, and no restart serves it again
                    log.error("%s: vLLM stopped", checked.reason)
                    server.stop()
                    break
                self.kv.log(self.engine_args)
                while not self._stop.wait(0.5) and server.running:
                    pass
            except EngineFailed as e:
                self.last_error = e.message.splitlines()[0]
                log.error("vLLM failed: %s", self.last_error)
            except Exception as e:  # top of the thread: keep supervising whatever happened
                self.last_error = f"{type(e).__name__}: {e}"
                log.exception("vLLM supervision failed")
            if self._stop.is_set():
                server.stop()
                break
            cause = self.history.record_exit(server, self.started_at, self.settings.log_tail_lines)
            server.stop()
            with self._lock:
                self.ready = False
                if cause is not None:
                    self.last_error = (
                        f"vLLM exited (status {self.history.exits[-1].returncode}): {cause}"
                    )
                limit = self.settings.max_identical_failures
                if reason := self.history.give_up(cause, limit):
                    self.state, self.last_error = "failed", reason
                    break
                self.state = "restarting"
            delay = backoff_delay(
                self.history.failures,
                self.settings.restart_backoff_s,
                self.settings.restart_backoff_max_s,
            )
            log.warning("restarting vLLM in %.1f s (restart %d)", delay, self.history.restarts)
            self._stop.wait(delay)
        with self._lock:
            self.ready = False

    # -- parity: is what vLLM serves what was trained? (lorastack.parity) -----------------

    def _check_served_parity(self, server: VllmServer) -> parity.Checked:
        """Check the model, then load and check every adapter of the registry (_admit);
        drop those refused. Returns the model's own check: when it may not be served
        (`serve` false, `reason` says why), no adapter is loaded."""
        checked = self.parity.check(
            server.base_url, self.settings.resolved_served_name, self.plan.model.path
        )
        if not checked.serve:
            return checked
        for name, adapter in self.adapters.items():
            try:
                self._admit(server, adapter)
            except (Refused, EngineFailed) as e:
                if not server.running:
                    raise  # vLLM died: the loop restarts it, and every adapter is loaded again
                log.error("adapter %s not served: %s", name, e.message)
                with self._lock:
                    self._adapters.pop(name, None)
        return checked

    def _admit(self, server: VllmServer, adapter: ServedAdapter, *, inplace: bool = False) -> None:
        """Serve `adapter` under its served name only once it passed its parity check, run
        under a private name no client can ask for; the private name is unloaded whatever
        happens. Refused (409) with the cause when it fails or its check cannot run."""
        url, key, name = server.base_url, self._vllm_key, adapter.served_name
        if self.settings.parity == "off" or not (adapter.path / REFERENCE_FILE).is_file():
            self.parity.check(url, name, adapter.path)  # records why nothing was checked
            vllm_api.load_lora(url, name, adapter.path, inplace=inplace, api_key=key)
            return
        private = f"{CHECK_PREFIX}{secrets.token_hex(8)}"
        vllm_api.load_lora(url, private, adapter.path, api_key=key)
        try:
            checked = self.parity.check(
                url,
                name,
                adapter.path,
                served_base_digest=self.plan.model.manifest.digest,
                asked_as=private,
            )
        finally:
            try:
                vllm_api.unload_lora(url, private, api_key=key)
            except EngineFailed as e:
                log.warning("could not unload %s (%s): %s", private, name, e.message)
        if not checked.serve:
            raise Refused(checked.reason, "see /status parity for the numbers")
        vllm_api.load_lora(url, name, adapter.path, inplace=inplace, api_key=key)

    # -- adapters ----------------------------------------------------------------------

    def require_ready(self) -> VllmServer:
        """The running server; EngineFailed while vLLM is not ready."""
        with self._lock:
            if not self.ready or self.server is None:
                raise EngineFailed(
                    f"vLLM is not ready (state: {self.state})", "retry when /ready answers 200"
                )
            return self.server

    def fetch_adapter(self, ref: str, source: str = "declared") -> ServedAdapter:
        """Resolve, check (kind, base, rank) and fetch (verified) an adapter for this model."""
        if not self.settings.enable_lora:
            raise EngineFailed(
                "this server runs without LoRA",
                "restart it with enable_lora: true (or list adapters in the config)",
                status=409,
            )
        adapter = fetch_adapter(
            self.store,
            ref,
            self.plan.model,
            max_lora_rank=self.settings.max_lora_rank,
            source=source,
            workdir=self.settings.resolved_workdir,
        )
        check_adapter(self.plan.chat, adapter.manifest)
        return adapter

    def load_adapter(self, ref: str) -> ServedAdapter:
        """Fetch (verified) and load an adapter from the store under `<name>-v<version>`."""
        return self.add_adapter(self.fetch_adapter(ref))

    def check_not_loaded(self, adapter: ServedAdapter) -> None:
        """Conflict when an adapter of that served name is loaded already."""
        with self._lock:
            if adapter.served_name in self._adapters:
                raise Conflict(
                    f"{adapter.served_name} is already loaded",
                    "it follows its label: POST /admin/labels/refresh to look now"
                    if adapter.follows
                    else "a new version gets a new name: publish and load the next version",
                )

    def add_adapter(self, adapter: ServedAdapter) -> ServedAdapter:
        """Check a fetched adapter's parity under a private name, then load it into vLLM
        under its served name and into the registry (a restart loads it again)."""
        self.check_not_loaded(adapter)
        server = self.require_ready()
        self._admit(server, adapter)
        with self._lock:
            self._adapters[adapter.served_name] = adapter
        log.info("loaded adapter %s as %s", adapter.manifest.ref, adapter.served_name)
        return adapter

    def switch_adapter(self, new: ServedAdapter) -> ServedAdapter:
        """Serve `new` in place of the adapter of the same served name (a followed label
        moved) once it passed its check; returns the one it replaced. vLLM loads it in place
        from the version's own path, so requests never find the name missing; a refused
        version leaves the old one served."""
        check_adapter(self.plan.chat, new.manifest)
        with self._lock:
            old = self._adapters.get(new.served_name)
        if old is None:
            raise NotFound(f"no adapter {new.served_name!r} is loaded", "it was unloaded")
        server = self.require_ready()
        served = self.parity.results().get(new.served_name)
        try:
            self._admit(server, new, inplace=True)
        except Refused as e:
            self.parity.restore(new.served_name, served)  # the record of what is served
            raise Refused(f"{e.message}; {old.manifest.ref} stays served", e.hint) from None
        with self._lock:
            self._adapters[new.served_name] = new
        log.info(
            "%s moved: %s now serves %s (was %s)",
            new.follows,
            new.served_name,
            new.manifest.ref,
            old.manifest.ref,
        )
        return old

    def unload_adapter(self, served_name: str) -> ServedAdapter:
        """Unload a served adapter from vLLM; NotFound if none of that name is loaded."""
        validate_name(served_name, "served adapter name")
        with self._lock:
            adapter = self._adapters.get(served_name)
        if adapter is None:
            raise NotFound(
                f"no adapter {served_name!r} is loaded",
                f"loaded: {', '.join(self.adapters) or 'none'}",
            )
        server = self.require_ready()
        vllm_api.unload_lora(server.base_url, served_name, api_key=self._vllm_key)
        with self._lock:
            self._adapters.pop(served_name, None)
        log.info("unloaded adapter %s", served_name)
        return adapter

    @property
    def adapters(self) -> dict[str, ServedAdapter]:
        with self._lock:
            return dict(self._adapters)

    # -- reporting ---------------------------------------------------------------------

    def status(self) -> SupervisorStatus:
        """The supervisor's part of /status: state, model, adapters, server, restarts, KV,
        parity."""
        with self._lock:
            server = self.server
            exits = list(self.history.exits)
            state, ready = self.state, self.ready
        return SupervisorStatus(
            state=state,
            ready=ready,
            platform=self.plan.platform,
            model=ModelStatus.of(self.plan.model, self.settings.resolved_served_name),
            adapters=[a.describe() for a in self.adapters.values()],
            dtype={"served": self.plan.dtype, "why": self.plan.dtype_reason},
            parity=self.parity.results(),
            chat_format=self.plan.chat.describe(),
            vllm=VllmStatus.of(server, started_at=self.started_at, ready=ready),
            restarts=self.history.restarts,
            last_error=self.last_error,
            root_cause=RootCauseStatus.of(self.history.root_cause),
            last_exit=exits[-1].__dict__ if exits else None,
            kv_cache=self.kv.comparison(),
            log_tail=server.log_tail(self.settings.log_tail_lines).splitlines() if server else [],
        )
