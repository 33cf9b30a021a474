"""The support memo a failed run leaves (`support-bundle.json`): the last log lines
(LogTail), whether it ran out of memory and the knob to turn (OOM_HINT), the versions and
the environment without its secrets. When it is written and published is
trainer.publish.failure's.
"""

from __future__ import annotations

import collections
import logging
import platform
import re
import traceback
from pathlib import Path
from typing import Any

import torch

from trainer.readings import cuda_versions, library_versions
from trainer.records import write_json


class LogTail(logging.Handler):
    """Keeps the last N formatted log lines for the support bundle."""

    def __init__(self, size: int = 20) -> None:
        super().__init__()
        self.lines: collections.deque[str] = collections.deque(maxlen=size)
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        """Keep the formatted record (the oldest line drops out beyond N)."""
        self.lines.append(self.format(record))


def is_oom(exc: BaseException) -> bool:
    """Whether `exc` says the device or the host ran out of memory."""
    return (
        isinstance(exc, torch.OutOfMemoryError | MemoryError) or "out of memory" in str(exc).lower()
    )


OOM_HINT = (
    "out of memory: halve micro_batch and double grad_accum (same effective batch, same seed), "
    "or lower max_seq_len, or set gradient_checkpointing=true or quantization=nf4"
)


# environment variables whose values never enter a support bundle, by name or by value
SECRET_NAME = re.compile(r"KEY|SECRET|TOKEN|PASSW|CREDENTIAL|AUTH|COOKIE|SESSION", re.I)


SECRET_VALUE = re.compile(r"^(hf_|sk-|ghp_|github_pat_|AKIA|ASIA|xox[abp]-|eyJ)")


def environment_summary(env: dict[str, str]) -> dict[str, str]:
    """The environment with every secret-looking value replaced by "<redacted>"."""
    return {
        k: "<redacted>" if SECRET_NAME.search(k) or SECRET_VALUE.match(v) else v
        for k, v in sorted(env.items())
    }


def write_support_bundle(
    path: Path,
    exc: BaseException,
    facts: dict[str, Any],
    log_tail: list[str],
    env: dict[str, str] | None = None,
) -> Path:
    """The support memo of a failed run: what a helper asks for first (template, GPU,
    versions, sequence length, batch, the failing step, the last log lines, the knob to
    turn on an OOM) and the environment without its secrets."""
    bundle = {
        **facts,
        "libraries": library_versions(),
        "python": platform.python_version(),
        **cuda_versions(),
        "last_log_lines": log_tail[-20:],
        "exception": {
            "type": type(exc).__name__,
            "message": str(exc),
            "traceback": traceback.format_exception(exc),
        },
        "oom": is_oom(exc),
        "hint": OOM_HINT
        if is_oom(exc)
        else getattr(exc, "hint", "") or "attach this file to a bug report",
        "environment": environment_summary(env or {}),
    }
    write_json(path, bundle)
    return path
