"""What a run reads of its machine: library and CUDA versions, the device's name and memory,
NVML's reading, the bytes held and at peak, the process's age. Reads, never writes: the
records these go into are trainer.records', trainer.publish.completion's and the support
memo's (trainer.support_bundle).
"""

from __future__ import annotations

import platform
import resource
import time
from importlib.metadata import PackageNotFoundError, version
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


def process_age() -> float:
    """Seconds since this process started (interpreter start and imports)."""
    import psutil

    return round(time.time() - psutil.Process().create_time(), 2)
