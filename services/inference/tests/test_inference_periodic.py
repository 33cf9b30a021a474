"""`inference.periodic`: a look repeated in a daemon thread until stopped."""

from __future__ import annotations

import threading

from inference.periodic import Periodic


def test_looks_repeat_in_a_named_daemon_thread_until_stopped() -> None:
    looks: list[threading.Thread] = []
    three = threading.Event()

    def look() -> None:
        looks.append(threading.current_thread())
        if len(looks) == 3:
            three.set()

    timer = Periodic("test-looks", 0.01, look)
    timer.start()
    assert three.wait(5)
    timer.stop()
    done = len(looks)
    assert not any(t.is_alive() for t in looks)
    assert {(t.name, t.daemon) for t in looks} == {("test-looks", True)}
    assert three.wait(0.05) and len(looks) == done  # none after the stop


def test_a_stop_without_a_start_waits_for_nothing() -> None:
    Periodic("never", 60, lambda: None).stop()
