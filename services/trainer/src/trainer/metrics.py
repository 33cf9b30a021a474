"""Run records: metrics files, memory readings, the support bundle.

Owns `metrics/metrics-step-N.json` (one per log interval), `metrics/eval-step-N.json`
and `support-bundle.json` written on a crash. It reads devices (torch, NVML, RSS) but
never trains. The loss plot is `trainer.plotting`'s.
"""

from __future__ import annotations

import collections
import json
import logging
import platform
import re
import resource
import time
import traceback
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import torch

LIBRARIES = ("torch", "transformers", "peft", "bitsandbytes", "accelerate", "safetensors")


def library_versions() -> dict[str, str]:
    """The installed version of each library in LIBRARIES ('absent' when not installed)."""
    out = {}
    for name in LIBRARIES:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "absent"
    return out


def nvml_reading(device: torch.device) -> dict[str, float]:
    """What nvidia-smi would show for the run's GPU: memory used and total (bytes),
    utilisation over NVML's last sample period (0..1) and power draw (W); empty without a
    GPU or where NVML is missing (some containers): the torch numbers remain."""
    if device.type != "cuda":
        return {}
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
        mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
        return {
            "used_bytes": int(mem.used),
            "total_bytes": int(mem.total),
            "utilization": pynvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100,
            "power_watts": pynvml.nvmlDeviceGetPowerUsage(handle) / 1000,
        }
    except Exception:
        return {}


def memory_now(device: torch.device) -> dict[str, int]:
    """Bytes: peak allocated/reserved from torch and NVML used on GPU; RSS on CPU."""
    if device.type == "cuda":
        out = {
            "peak_allocated": int(torch.cuda.max_memory_allocated(device)),
            "peak_reserved": int(torch.cuda.max_memory_reserved(device)),
        }
        nvml = nvml_reading(device)
        if nvml:
            out["nvml_used"] = int(nvml["used_bytes"])
        return out
    import psutil

    return {
        "rss": int(psutil.Process().memory_info().rss),
        "peak_rss": int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024,
    }


def held_bytes(device: torch.device) -> int:
    """Bytes held now: torch's live allocations on a GPU, the process's RSS on the CPU."""
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    import psutil

    return int(psutil.Process().memory_info().rss)


def peak_bytes(device: torch.device) -> int:
    """Peak memory of `device` so far: allocated on CUDA, the process's RSS on CPU."""
    m = memory_now(device)
    return m.get("peak_allocated", m.get("peak_rss", 0))


def device_facts(device: torch.device) -> dict[str, Any]:
    """The device's name and its total memory in bytes."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return {"device": props.name, "memory": int(props.total_memory)}
    import psutil

    return {
        "device": f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)",
        "memory": int(psutil.virtual_memory().total),
    }


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write `data` as JSON to `path` atomically (a .tmp file, then a rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)


def read_series(metrics_dir: Path, prefix: str, key: str) -> dict[int, float]:
    """{step: value} from metrics_dir/<prefix>-step-N.json files."""
    out = {}
    for p in metrics_dir.glob(f"{prefix}-step-*.json"):
        data = json.loads(p.read_text())
        out[int(data["step"])] = float(data[key])
    return dict(sorted(out.items()))


def process_age() -> float:
    """Seconds since this process started (interpreter start and imports)."""
    import psutil

    return round(time.time() - psutil.Process().create_time(), 2)


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


def cuda_versions() -> dict[str, str]:
    """CUDA runtime (torch's build) and driver versions, where there is a GPU."""
    if not torch.cuda.is_available():
        return {}
    out = {"cuda_runtime": str(torch.version.cuda)}
    try:
        import pynvml

        pynvml.nvmlInit()
        out["driver"] = str(pynvml.nvmlSystemGetDriverVersion())
    except Exception:  # NVML missing in some containers
        pass
    return out


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
