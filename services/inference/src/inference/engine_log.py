"""Why a vLLM died, read from its log: the engine's root cause and what to do about it.

Pure functions over the log text (the supervisor reads the file, `engine.py` owns it).
vLLM's API server and its engine core are separate processes writing to one log; when the
engine dies while starting, the API server's own traceback comes last and says only
"Engine core initialization failed. See root cause above." The cause is the *first*
exception the engine process logged (e.g. `ModuleNotFoundError: No module named
'flashinfer'` after the weights load, vLLM 0.26 on CUDA without FlashInfer).

Lines look like `(EngineCore_DP0 pid=12) ERROR 12-03 09:00:00 [core.py:708] Traceback ...`
(vLLM 0.26 and 0.32 alike); the process prefix and the logger's level/time/place are
stripped before a line is read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_PREFIX = re.compile(
    r"^(?:\((?P<proc>[\w.\-]+) pid=\d+\)\s?)?"
    r"(?:(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)? \[[^\]]*\] )?"
)
# the last line of a traceback: `pkg.ErrorName: message` (or the bare name)
_EXCEPTION = re.compile(
    r"^(?P<name>[A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Warning))\b(?::\s?(?P<msg>.*))?$"
)
_API_SERVER = ("APIServer", "ApiServer")

# known causes -> what to change (the first pattern found in the cause wins)
_HINTS: tuple[tuple[str, str], ...] = (
    (
        "No module named 'flashinfer'",
        "vLLM's FlashInfer sampler is on by default on CUDA: install flashinfer-python, or"
        " set VLLM_USE_FLASHINFER_SAMPLER=0 (the supervisor sets it when flashinfer is absent)",
    ),
    (
        "CUDA out of memory",
        "lower gpu_memory_utilization, max_model_len or max_num_seqs (lorastack kv-estimate)",
    ),
    (
        "No available memory for the cache blocks",
        "the weights leave no room for the KV cache: raise gpu_memory_utilization or use a"
        " smaller model",
    ),
    ("No module named", "a Python package vLLM needs is missing: install it beside vLLM"),
)


@dataclass(frozen=True)
class RootCause:
    """The first exception of the failing process, as `Name: message`."""

    exception: str  # e.g. "ModuleNotFoundError"
    message: str
    process: str | None  # vLLM's process label (EngineCore_DP0), None when unprefixed

    def __str__(self) -> str:
        return f"{self.exception}: {self.message}" if self.message else self.exception

    @property
    def hint(self) -> str:
        text = str(self)
        for pattern, hint in _HINTS:
            if pattern in text:
                return hint
        return "fix the cause in vLLM's log, then restart lorastack serve"


def _strip(line: str) -> tuple[str | None, str]:
    m = _PREFIX.match(line)
    assert m is not None  # every part of the prefix is optional
    return m.group("proc"), line[m.end() :]


def root_cause(log_text: str) -> RootCause | None:
    """The first exception that ends a traceback in `log_text`, preferring the engine's
    processes over the API server's (whose traceback only points back at the engine)."""
    found: list[RootCause] = []
    in_traceback: dict[str | None, bool] = {}
    for raw in log_text.splitlines():
        proc, line = _strip(raw.rstrip())
        if line.startswith("Traceback (most recent call last)"):
            in_traceback[proc] = True
            continue
        if not in_traceback.get(proc) or not line or line[0].isspace():
            continue  # a frame, its source line, or nothing of interest
        m = _EXCEPTION.match(line)
        if m:
            found.append(RootCause(m.group("name"), (m.group("msg") or "").strip(), proc))
        in_traceback[proc] = False
    engine = [c for c in found if c.process is not None and not c.process.startswith(_API_SERVER)]
    first = engine or found
    return first[0] if first else None
