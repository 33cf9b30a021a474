"""The deployment's declared adapters, applied to this replica: changed by /admin, reconciled
at start and on change, so every replica (a restarted one, a new one) serves the same set.

Owns when the declaration is read and what this replica loads or unloads to match it; not
the declaration record (`lorastack.store.declared`) nor the load itself (`Supervisor`).

- `POST /admin/adapters` (`declare`): the ref is fetched and checked first (an adapter this
  server cannot serve is refused, never declared), pinned (`NAME` -> `NAME:VERSION`;
  `NAME@LABEL` stays a label), declared in the store, then loaded here. If vLLM refuses
  the load, the declaration is withdrawn again and the error answered.
- `DELETE /admin/adapters/SERVED` (`withdraw`): withdrawn from the declaration, unloaded here.
- `check`, on every vLLM start that reaches ready, every `adapter_sync_s` seconds and on
  `POST /admin/adapters/refresh`: each declared adapter not loaded here is loaded; each
  adapter loaded from the declaration and no longer declared is unloaded. Adapters of the
  serve config (`adapters:`) are left alone: every replica loads them at start anyway.

Reconciling is idempotent: a look that finds the replica matching changes nothing. A declared
entry this replica cannot serve (deleted from the store, trained on another base, a rank over
max_lora_rank, refused by vLLM) is skipped: logged once, shown on /status under
`declared.errors` with what to do, counted in `lorastack_inference_declared_errors`, tried
again at the next look. A store that does not answer keeps what is loaded.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from inference.artifacts import ServedAdapter
from inference.periodic import Periodic
from inference.supervisor import Supervisor
from lorastack.errors import LorastackError
from lorastack.manifest import validate_name
from lorastack.store import declared
from lorastack.store.declared import Declaration, DeclaredAdapter

log = logging.getLogger(__name__)
TICK_S = 0.25  # seconds between looks at whether a check is due (cheap: no I/O)


class AdapterReconciler:
    """Keeps this replica's adapters in line with the deployment's declaration in the store."""

    def __init__(self, supervisor: Supervisor) -> None:
        self.supervisor = supervisor
        self.deployment = supervisor.settings.resolved_deployment
        self.interval_s = supervisor.settings.adapter_sync_s  # seconds; 0 = at start only
        self._lock = threading.Lock()  # one change or look at a time (timer, admin routes)
        self._looks = Periodic("adapter-sync", TICK_S, self._look)
        self.declaration = Declaration(deployment=self.deployment)  # as last read
        self.last_check = 0.0  # unix time of the last completed look
        self.synced_start = 0.0  # the supervisor's `started_at` that the last look saw
        self.loads = 0  # adapters loaded by reconciling, since start
        self.unloads = 0
        self.last_change: dict[str, list[str]] = {"loaded": [], "unloaded": []}
        self.errors: dict[str, str] = {}  # declared ref (or "store") -> what failed, what to do

    # -- the loop ----------------------------------------------------------------------

    def start(self) -> None:
        """Start syncing the served adapters with the declaration, in a daemon thread."""
        self._looks.start()

    def stop(self) -> None:
        """Stop the sync thread and wait for it (30 s at most)."""
        self._looks.stop()

    def due(self) -> bool:
        """A look is due: vLLM (re)started since the last one, or the interval has passed."""
        sup = self.supervisor
        if not sup.ready:
            return False
        if sup.started_at != self.synced_start:
            return True
        return self.interval_s > 0 and time.time() - self.last_check >= self.interval_s

    def _look(self) -> None:
        if not self.due():
            return
        try:
            self.check()
        except Exception:  # top of the thread: keep reconciling whatever happened
            log.exception("reconciling the declared adapters failed")
            self.last_check = time.time()  # next try after the interval, not at once
            self.synced_start = self.supervisor.started_at

    # -- reconciling -------------------------------------------------------------------

    def check(self) -> dict[str, Any]:
        """Look once and make this replica serve the declared adapters; what it changed."""
        with self._lock:
            return self._reconcile()

    def _reconcile(self) -> dict[str, Any]:
        sup = self.supervisor
        if not sup.ready:
            return {"loaded": [], "unloaded": [], "skipped": f"vLLM is {sup.state}"}
        started = sup.started_at
        try:
            decl = declared.current(sup.store.backend, self.deployment)
        except LorastackError as e:
            self._note("store", f"cannot read the declared adapters: {e.message}", e.hint)
            self.last_check, self.synced_start = time.time(), started
            return {"loaded": [], "unloaded": [], "skipped": self.errors["store"]}
        errors: dict[str, str] = {}
        loaded: list[str] = []
        unloaded: list[str] = []
        have = sup.adapters
        for entry in decl.adapters:
            if entry.served_name in have:
                continue
            try:
                sup.add_adapter(sup.fetch_adapter(entry.ref))
                loaded.append(entry.ref)
            except LorastackError as e:
                errors[entry.ref] = self._cannot_serve(entry, e)
        wanted = set(decl.served_names())
        for served, adapter in have.items():
            if adapter.source == "declared" and served not in wanted:
                try:
                    sup.unload_adapter(served)
                    unloaded.append(served)
                except LorastackError as e:
                    errors[served] = f"cannot unload {served}: {e.message} ({e.hint or 'retry'})"
        for ref, why in errors.items():
            if self.errors.get(ref) != why:
                log.warning("declared adapters of %s: %s", self.deployment, why)
        if loaded or unloaded:
            log.info(
                "declared adapters of %s (seq %d): loaded %s, unloaded %s",
                self.deployment,
                decl.seq,
                loaded or "-",
                unloaded or "-",
            )
            self.last_change = {"loaded": loaded, "unloaded": unloaded}
        self.errors = errors
        self.declaration = decl
        self.loads += len(loaded)
        self.unloads += len(unloaded)
        self.synced_start = started
        self.last_check = time.time()
        return {"seq": decl.seq, "loaded": loaded, "unloaded": unloaded, "errors": errors}

    def _cannot_serve(self, entry: DeclaredAdapter, e: LorastackError) -> str:
        fix = e.hint + "; or " if e.hint else ""
        return (
            f"declared adapter {entry.ref} is not served here: {e.message} (what to do: {fix}"
            f"withdraw it: DELETE /admin/adapters/{entry.served_name})"
        )

    def _note(self, key: str, message: str, hint: str) -> None:
        text = f"{message} ({hint})" if hint else message
        if self.errors.get(key) != text:
            log.warning("declared adapters of %s: %s", self.deployment, text)
        self.errors = {**self.errors, key: text}

    # -- changing the declaration (the /admin routes) ----------------------------------

    def declare(self, ref: str) -> tuple[ServedAdapter, Declaration]:
        """Check, declare for every replica, and load here (see the module docstring)."""
        sup = self.supervisor
        adapter = sup.fetch_adapter(ref)
        entry = DeclaredAdapter(
            ref=adapter.follows or adapter.manifest.ref,
            served_name=adapter.served_name,
            digest=adapter.manifest.digest,
        )
        with self._lock:
            sup.check_not_loaded(adapter)
            sup.require_ready()
            before = declared.current(sup.store.backend, self.deployment)
            decl = declared.declare(sup.store.backend, self.deployment, entry)
            try:
                sup.add_adapter(adapter)
            except LorastackError:
                if entry.served_name not in before.served_names():
                    declared.withdraw(sup.store.backend, self.deployment, entry.served_name)
                raise
            self.declaration = decl
            return adapter, decl

    def withdraw(self, served_name: str) -> tuple[ServedAdapter | None, Declaration]:
        """Withdraw from the declaration and unload here; NotFound when neither applies."""
        validate_name(served_name, "served adapter name")
        sup = self.supervisor
        with self._lock:
            before = declared.current(sup.store.backend, self.deployment)
            decl = declared.withdraw(sup.store.backend, self.deployment, served_name)
            self.declaration = decl
            was_declared = served_name in before.served_names()
            if was_declared and served_name not in sup.adapters:
                return None, decl
            return sup.unload_adapter(served_name), decl

    def status(self) -> dict[str, Any]:
        """The declaration and the sync's counts, last change and errors, for /status."""
        d = self.declaration
        return {
            "deployment": self.deployment,
            "seq": d.seq,
            "adapters": [a.model_dump() for a in d.adapters],
            "sync_s": self.interval_s,
            "last_check": self.last_check or None,
            "loads": self.loads,
            "unloads": self.unloads,
            "last_change": self.last_change,
            "errors": dict(self.errors),
        }
