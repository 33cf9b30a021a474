"""Following labelled adapters (`NAME@LABEL`): the served name stays, the version moves.

Owns when and how often labels are looked at, not the label (the store's) nor the
in-place load (`Supervisor.switch_adapter`). Every `label_refresh_s` seconds, and on
`POST /admin/labels/refresh`, each adapter served from a labelled ref is resolved in the
store again; when the label points at other content, that version is fetched, verified,
checked against the served model and loaded in place under the same served name, so a
`lorastack promote` reaches `/v1/models` (and through it the gateway) without a restart.

A store that does not answer, or a label moved to something this server cannot serve
(another base, a rank over max_lora_rank), keeps the version being served: the error is
logged, shown on /status under `labels`, and the next look tries again. While vLLM is
not ready nothing is switched (a restart starts with the versions in the registry).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from inference.artifacts import fetch_adapter, resolve
from inference.periodic import Periodic
from inference.supervisor import Supervisor
from lorastack.errors import LorastackError

log = logging.getLogger(__name__)


class LabelFollower:
    """Moves adapters served as NAME@LABEL to the version their label points at."""

    def __init__(self, supervisor: Supervisor) -> None:
        self.supervisor = supervisor
        self.interval_s = supervisor.settings.label_refresh_s  # seconds; 0 = on request only
        self._check_lock = threading.Lock()  # one look at a time (timer and admin route)
        self._looks = Periodic("label-follower", self.interval_s, self._look)
        self.last_check = 0.0  # unix time of the last completed look
        self.errors: dict[str, str] = {}  # labelled ref -> why it was not followed
        self.switches = 0  # versions switched since start

    def start(self) -> None:
        """Start following labels in a daemon thread (none when the interval is 0)."""
        if self.interval_s > 0:  # a look with no labelled adapter costs nothing
            self._looks.start()

    def stop(self) -> None:
        """Stop the follower thread and wait for it (30 s at most)."""
        self._looks.stop()

    def _look(self) -> None:
        try:
            self.check()
        except Exception:  # top of the thread: keep following whatever happened
            log.exception("following labels failed")

    def check(self) -> list[dict[str, str]]:
        """Look once: switch every followed adapter whose label moved; the switches made."""
        sup = self.supervisor
        done: list[dict[str, str]] = []
        with self._check_lock:
            if not sup.ready:
                return done
            for served, adapter in sorted(sup.adapters.items()):
                if not adapter.follows:
                    continue
                try:
                    now = resolve(sup.store, adapter.follows)
                    if now.digest != adapter.manifest.digest:
                        new = fetch_adapter(
                            sup.store,
                            adapter.follows,
                            sup.plan.model,
                            max_lora_rank=sup.settings.max_lora_rank,
                            source=adapter.source,
                            workdir=sup.settings.resolved_workdir,
                            manifest=now,
                        )
                        old = sup.switch_adapter(new)
                        self.switches += 1
                        done.append(
                            {"served_name": served, "from": old.manifest.ref, "to": now.ref}
                        )
                    self.errors.pop(adapter.follows, None)
                except LorastackError as e:
                    if self.errors.get(adapter.follows) != e.message:
                        log.warning(
                            "%s: still serving %s: %s", adapter.follows, adapter.manifest.ref, e
                        )
                    self.errors[adapter.follows] = e.message
            self.last_check = time.time()
        return done

    def status(self) -> dict[str, Any]:
        """The follower's interval, last check, switches and errors, for /status."""
        return {
            "refresh_s": self.interval_s,
            "last_check": self.last_check or None,
            "switches": self.switches,
            "errors": dict(self.errors),
        }
