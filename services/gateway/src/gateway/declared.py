"""Adapters declared in the store that no backend lists yet: answered 503 + Retry-After.

Owns the gateway's copy of the served names every deployment declares
(`lorastack.store.declared`), read from the store in a worker thread at most every
`declared_refresh_s` seconds (by the background refresh, and at most once a second when a
request names a model no backend lists); not routing: a request goes only to backends
whose `/v1/models` lists its model (`routing.pick_backend`).

The gateway does not load adapters itself: every inference replica reconciles to its
deployment's declaration on its own (within its `adapter_sync_s`), so the gateway needs no
admin key and no supervisor addresses. A request naming a declared adapter that no backend
lists yet (just declared, or its replicas restarting) is answered 503 `adapter_loading`
with `Retry-After`; a request naming a model neither listed nor declared stays a 404.
A store that does not answer keeps the last copy (the error is logged once).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import anyio

from gateway.errors import AdapterLoading
from gateway.settings import GatewaySettings
from lorastack.store import Backend, declared, open_store

log = logging.getLogger(__name__)


class DeclaredAdapters:
    """The adapters declared in the store (served name -> deployment), read again every
    `declared_refresh_s`."""

    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.interval_s = settings.declared_refresh_s  # seconds; 0 = off
        self.names: dict[str, str] = {}  # served adapter name -> its deployment
        self.read_at = 0.0  # monotonic seconds of the last read (good or not)
        self.error = ""
        self._lock = anyio.Lock()
        self._backend: Backend | None = None

    def _read(self) -> dict[str, str]:
        url = self.settings.resolved_store_url
        if url.startswith("file://") and not Path(url.removeprefix("file://")).is_dir():
            return {}  # no store here yet, so nothing declared (and nothing created)
        if self._backend is None:  # opened once: an S3 client costs ~0.1 s of CPU to build
            self._backend = open_store(self.settings).backend
        backend = self._backend
        return {
            name: d.deployment for d in declared.all_current(backend) for name in d.served_names()
        }

    async def refresh(self, max_age_s: float | None = None) -> None:
        """Read the declarations again when the last read is older than `max_age_s`
        (default: the refresh interval)."""
        if self.interval_s <= 0:
            return
        age = self.interval_s if max_age_s is None else max_age_s
        async with self._lock:
            if time.monotonic() - self.read_at < age:
                return
            try:
                self.names = await anyio.to_thread.run_sync(self._read)
                self.error = ""
            except Exception as e:  # the store is a boundary: keep the last copy
                if not self.error:
                    log.warning("cannot read the declared adapters from the store: %s", e)
                self.error = f"{type(e).__name__}: {e}"
            self.read_at = time.monotonic()

    def check_loading(self, model: str) -> None:
        """AdapterLoading when `model` is a declared adapter (that no backend lists)."""
        deployment = self.names.get(model)
        if deployment is not None:
            wait = max(1.0, self.settings.scrape_interval_s)
            raise AdapterLoading(
                f"the adapter `{model}` is declared for deployment {deployment} but no backend"
                " serves it yet: its replicas are loading it",
                "retry after the Retry-After delay; if this lasts, see `declared.errors` on"
                " the inference supervisor's /status",
                retry_after_s=wait,
            )
