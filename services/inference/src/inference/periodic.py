"""A look repeated in a daemon thread until stopped: the loops of the label follower
(`inference.label_follow`) and the declared-adapters reconciler (`inference.declared_adapters`).

Owns the thread, its name, the wait between two looks and the stop, which waits for a look
under way (30 s at most). Does not own what a look does nor what it does when it fails:
that is its owner's, which catches what it must (an exception out of a look ends the thread).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

STOP_WAIT_S = 30.0  # seconds `stop` waits for a look under way


class Periodic:
    """Calls `look` every `every_s` seconds in a daemon thread named `name`, from `start`
    until `stop`."""

    def __init__(self, name: str, every_s: float, look: Callable[[], None]) -> None:
        self.name = name
        self.every_s = every_s  # seconds from the end of one look to the next
        self.look = look
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the thread; its first look comes `every_s` seconds after."""
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread and wait for it (STOP_WAIT_S at most); none started, nothing to
        wait for."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=STOP_WAIT_S)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.look()
