"""`lorastack doctor`: pins against what is installed, and the CLI's exit code."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

from lorastack_app.doctor import check_gpu_processes, check_package, read_pins


def test_pins_are_read_and_mismatches_explained(tmp_path: Path) -> None:
    (tmp_path / "constraints.txt").write_text("# pins\nPyYAML==1.0\ntorch==2.13.0\n")
    pins = read_pins(tmp_path / "constraints.txt")
    assert pins == {"pyyaml": "1.0", "torch": "2.13.0"}
    row = check_package("pyyaml", "settings", pins)
    assert row.status == "warn" and "1.0 pinned" in row.detail and "constraints" in row.hint
    assert check_package("torch", "trainer", pins).status == "ok"  # 2.13.0+cpu matches 2.13.0
    missing = check_package("no-such-dist", "nothing", pins)
    assert missing.status == "warn" and "not installed" in missing.detail


def test_doctor_runs_and_reports_json(home: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "lorastack.cli", "doctor", "--json"],
        capture_output=True,
        text=True,
        check=False,
    )
    rows = {r["name"]: r for r in json.loads(out.stdout)}
    assert out.returncode == 0, out.stdout
    assert rows["python"]["status"] in ("ok", "warn")
    assert rows["store"]["status"] == "ok" and str(home) in rows["store"]["detail"]


class FakeNVML:
    """The NVML boundary (pynvml's module functions) over a fixed process table."""

    class NVMLError(Exception):
        pass

    def __init__(self, gpus: list[list[tuple[int, int]]]) -> None:
        self.gpus = gpus  # per GPU: (pid, bytes of GPU memory)

    def nvmlInit(self) -> None:
        pass

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int) -> list[SimpleNamespace]:
        return [SimpleNamespace(pid=p, usedGpuMemory=b) for p, b in self.gpus[handle]]

    def nvmlSystemGetDriverVersion(self) -> str:
        return "580.159.04"


def test_the_doctors_own_cuda_context_is_no_other_process() -> None:
    me = 4242
    idle = FakeNVML([[(me, 512 * 2**20)]])  # only the context check_torch_device created
    rows = check_gpu_processes(idle, own_pid=me)
    assert [r.name for r in rows] == ["nvidia driver"]
    assert all(r.status == "info" for r in rows)

    busy = FakeNVML([[(me, 512 * 2**20), (7, 40 * 2**30)], [(me, 2**20)]])
    rows = check_gpu_processes(busy, own_pid=me)
    held = [r for r in rows if r.status == "warn"]
    assert len(held) == 1 and held[0].name == "gpu0 processes"
    assert held[0].detail == "pid 7: 40.0 GiB" and "another process" in held[0].hint


def test_nvml_failure_is_a_warning_with_a_hint() -> None:
    class Broken(FakeNVML):
        def nvmlInit(self) -> None:
            raise self.NVMLError("Driver Not Loaded")

    [row] = check_gpu_processes(Broken([]), own_pid=1)
    assert row.status == "warn" and "Driver Not Loaded" in row.detail and "nvidia-smi" in row.hint
