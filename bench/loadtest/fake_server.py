"""Serve lorastack's scripted fake upstream on a port until SIGTERM/SIGINT.

    .venv/bin/python bench/loadtest/fake_server.py PORT TTFT_S ITL_S

Used to check `lorastack loadtest` and `vllm bench serve` against known timing.
"""

from __future__ import annotations

import signal
import sys
import threading

from lorastack.evaluation.fake_upstream import FakeUpstream

if __name__ == "__main__":
    port, ttft, itl = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    with FakeUpstream(ttft_s=ttft, itl_s=itl, models=("smollm2",), port=port) as fake:
        print("READY", fake.base_url, flush=True)
        done.wait()
