"""Serve config, names, the vLLM command line, backoff and the CLI, without a running vLLM
(except the fail-fast test, which starts one that cannot load); vLLM's refusals worded
(against the fake vLLM)."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
from pathlib import Path

import psutil
import pytest
import yaml

from inference.artifacts import check_adapter_base, served_adapter_name
from inference.engine import EngineSpec, VllmServer
from inference.errors import EngineFailed
from inference.settings import build_settings, load_serve_config
from inference.supervisor import backoff_delay
from inference.vllm_api import load_lora, unload_lora
from lorastack import pidfile
from lorastack.cli import main as lorastack_main
from lorastack.errors import ConfigError, InvalidName, Refused
from lorastack.manifest import Manifest, Parent, Producer
from lorastack_testing.fake_vllm import FakeServer


def _write(tmp_path: Path, data: object) -> Path:
    p = tmp_path / "serve.yaml"
    p.write_text(yaml.safe_dump(data))
    return p


def test_serve_config_loads_and_fills_defaults(tmp_path: Path, home: Path) -> None:
    s = load_serve_config(_write(tmp_path, {"model": "runs/a/merged:3", "adapters": ["x/y:2"]}))
    assert s.resolved_served_name == "merged"
    assert s.enable_lora  # adapters switch LoRA on
    assert s.typical_tokens == s.max_model_len == 2048
    assert s.resolved_workdir == home.resolve() / "serve"


@pytest.mark.parametrize(
    ("data", "words"),
    [
        ({"model": "m", "max_model_len": 0}, "max_model_len"),
        ({"model": "m", "max_lora_rank": 12}, "max_lora_rank"),
        ({"model": "m", "gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"model": "m", "port": 9000, "supervisor_port": 9000}, "must differ"),
        ({"model": "m", "max_num_seq": 4}, "unknown setting(s): max_num_seq"),
        ({"adapters": []}, "names no model"),
        (["model", "m"], "mapping"),
    ],
)
def test_bad_serve_configs_say_what_to_fix(
    tmp_path: Path, home: Path, data: object, words: str
) -> None:
    with pytest.raises(ConfigError) as e:
        load_serve_config(_write(tmp_path, data))
    assert words in e.value.message
    assert "Value error" not in e.value.message  # pydantic's prefix, not ours
    assert e.value.hint


@pytest.mark.parametrize("ref", ["../x", "a//b", "/abs", "x:1/2"])
def test_bad_refs_are_invalid_names(home: Path, ref: str) -> None:
    with pytest.raises(InvalidName):
        build_settings(model=ref)
    with pytest.raises(InvalidName):
        build_settings(model="m", adapters=[ref])


def _manifest(
    name: str, version: str, digest: str, parents: list[Parent] | None = None
) -> Manifest:
    return Manifest(
        kind="adapter", name=name, version=version, digest=digest, files=[],
        created="now", producer=Producer(service="t"), parents=parents or [],
    )  # fmt: skip


def test_each_adapter_version_gets_its_own_served_name() -> None:
    assert served_adapter_name(_manifest("runs/a/adapter", "3", "d")) == "runs/a/adapter-v3"
    assert served_adapter_name(_manifest("x", "4", "d")) != served_adapter_name(
        _manifest("x", "3", "d")
    )


def test_an_adapter_for_another_base_is_refused() -> None:
    model = _manifest("base", "1", "sha256:aaa")
    other = Parent(role="base", name="other", version="2", digest="sha256:bbb")
    with pytest.raises(Refused, match="trained on other:2"):
        check_adapter_base(_manifest("ad", "1", "d", [other]), model)
    mine = Parent(role="base", name="base", version="1", digest="sha256:aaa")
    check_adapter_base(_manifest("ad", "1", "d", [mine]), model)
    check_adapter_base(_manifest("ad", "1", "d"), model)  # no recorded base: let through


@pytest.mark.parametrize(
    ("failures", "delay"), [(1, 2.0), (2, 4.0), (3, 8.0), (5, 32.0), (6, 60.0), (20, 60.0)]
)
def test_restart_backoff_doubles_and_is_capped(failures: int, delay: float) -> None:
    assert backoff_delay(failures, 2.0, 60.0) == delay


def test_cpu_command_and_environment(tmp_path: Path) -> None:
    s = VllmServer(EngineSpec(
        model_dir=tmp_path / "model", served_name="m", port=8123, workdir=tmp_path / "w",
        enable_lora=True, lora_modules={"a-v1": tmp_path / "a"}, platform="cpu",
    ))  # fmt: skip
    cmd = s.command()
    assert cmd[1:3] == ["-m", "inference.vllm_launcher"]
    assert {"--enforce-eager", "--enable-lora"} <= set(cmd)
    assert cmd[cmd.index("--dtype") + 1] == "float32"
    assert cmd[cmd.index("--lora-modules") + 1] == f"a-v1={tmp_path / 'a'}"
    assert "--gpu-memory-utilization" not in cmd
    env = s.environment()
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    # eager helpers: a logprobs request must not need a C++ compiler the image lacks
    assert env["TORCHDYNAMO_DISABLE"] == "1"
    assert env["VLLM_CACHE_ROOT"].startswith(str(tmp_path))
    half = VllmServer(EngineSpec(model_dir=tmp_path, served_name="m", port=1, workdir=tmp_path,
                                 kv_cache_gib=0.5, platform="cpu"))  # fmt: skip
    assert "VLLM_CPU_KVCACHE_SPACE" not in half.environment()  # the variable takes whole GiB
    assert half.command()[half.command().index("--kv-cache-memory-bytes") + 1] == str(2**29)


def test_vllm_sockets_fit_however_deep_the_workdir(tmp_path: Path) -> None:
    """vLLM binds ipc://TMPDIR/<uuid4>; a Unix socket path holds 107 bytes. A deep workdir
    (pytest-xdist's temp folders were one) gets a short TMPDIR of its own instead of a start
    that fails with ZMQError "ipc path ... is longer than 107"."""

    def tmpdir(workdir: Path) -> str:
        spec = EngineSpec(model_dir=tmp_path, served_name="m", port=1, workdir=workdir)
        return VllmServer(spec).environment()["TMPDIR"]

    assert tmpdir(Path("/srv/w")) == "/srv/w/tmp"  # room left: the workdir's own
    deep = Path("/srv") / ("d" * 80) / "w"
    short = tmpdir(deep)
    assert not short.startswith(str(deep)) and len(short) + 1 + 36 <= 107
    assert short == tmpdir(deep) != tmpdir(deep.parent / "other")  # one folder a workdir
    edge = Path("/" + "e" * (107 - 37 - len("/w/tmp") - 1)) / "w"  # the path + a uuid: 107
    assert tmpdir(edge) == f"{edge}/tmp" and len(f"{edge}/tmp") + 37 == 107


def test_cuda_command(tmp_path: Path) -> None:
    s = VllmServer(EngineSpec(
        model_dir=tmp_path, served_name="m", port=1, workdir=tmp_path, dtype="bfloat16",
        gpu_memory_utilization=0.85, platform="cuda",
    ))  # fmt: skip
    cmd = s.command()
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert cmd[cmd.index("--gpu-memory-utilization") + 1] == "0.85"
    assert "--enforce-eager" not in cmd and "--enable-lora" not in cmd
    assert "VLLM_CPU_KVCACHE_SPACE" not in s.environment()


def test_a_fixed_gpu_kv_cache_replaces_the_memory_profile(tmp_path: Path) -> None:
    """gpu_kv_cache_gib: vLLM takes that much for its KV cache and skips the start-up
    profile that counts another process's memory (the demo's training) as its own."""
    s = VllmServer(EngineSpec(
        model_dir=tmp_path, served_name="m", port=1, workdir=tmp_path, dtype="float16",
        gpu_kv_cache_gib=1.5, platform="cuda",
    ))  # fmt: skip
    cmd = s.command()
    assert cmd[cmd.index("--kv-cache-memory-bytes") + 1] == str(3 * 2**29)
    assert "--gpu-memory-utilization" not in cmd


@pytest.mark.slow
def test_a_crashed_start_fails_fast_with_the_log_tail(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "no-such-architecture"}')
    t0 = time.monotonic()
    with VllmServer(
        EngineSpec(model_dir=model, served_name="m", port=1, workdir=tmp_path / "w", platform="cpu")
    ) as s:
        with pytest.raises(EngineFailed) as e:
            s.wait_ready(timeout_s=600)
        assert s.returncode not in (None, 0)
    assert time.monotonic() - t0 < 300  # did not sit out the 600 s timeout
    assert "exited with status" in e.value.message
    assert "no-such-architecture" in e.value.message  # vLLM's own words, from the log tail


def test_a_vllm_left_by_a_killed_supervisor_is_stopped_before_the_next_start(
    tmp_path: Path,
) -> None:
    """The pid file names the group's leader and its supervisor, each with its create
    time; the group is stopped only if that supervisor is gone and the leader is still the
    process that was started (create time, command line) and runs in the workdir."""
    work = tmp_path / "w"
    work.mkdir()
    # the test decides when these die (killed at the end): a 60 s sleep could end by
    # itself on a loaded machine and read as "stopped"
    left = subprocess.Popen(["sleep", "3600"], cwd=work, start_new_session=True)
    other = subprocess.Popen(["sleep", "3600"], cwd=tmp_path, start_new_session=True)
    reaper = threading.Thread(target=left.wait)  # as init would reap an orphan
    reaper.start()

    def record(pid: int, owner: int, **change: object) -> None:
        ident = pidfile.identify(owner)
        pidfile.write_pidfile(
            s.pid_path, pid, owner={"pid": owner, "create_time": ident[0] if ident else 0.0}
        )
        if change:  # what a stale file holds: another process's create time or command line
            data = json.loads(s.pid_path.read_text()) | change
            s.pid_path.write_text(json.dumps(data))

    try:
        s = VllmServer(
            EngineSpec(model_dir=tmp_path, served_name="m", port=1, workdir=work, platform="cpu")
        )
        dead = subprocess.Popen(["true"])
        dead.wait()
        record(left.pid, other.pid)
        assert not s.stop_leftover()  # its supervisor still runs: not a leftover
        assert left.poll() is None and s.pid_path.exists()
        record(other.pid, dead.pid)
        assert not s.stop_leftover()  # runs elsewhere: a reused pid, left alone
        assert other.poll() is None and not s.pid_path.exists()
        created = psutil.Process(left.pid).create_time()
        record(left.pid, dead.pid, create_time=created - 3600.0)
        assert not s.stop_leftover()  # same pid, another process: left alone
        assert left.poll() is None and not s.pid_path.exists()
        record(left.pid, dead.pid, cmdline=["python", "-m", "vllm"])
        assert not s.stop_leftover()  # same pid, another command line: left alone
        assert left.poll() is None and not s.pid_path.exists()
        s.pid_path.write_text(f"{left.pid} {dead.pid}\n")  # an older lorastack's bare pids
        assert not s.stop_leftover()
        assert left.poll() is None and not s.pid_path.exists()
        record(left.pid, dead.pid)
        assert s.stop_leftover()
        reaper.join(timeout=60)
        assert left.returncode == -signal.SIGTERM
    finally:
        for p in (left, other):
            p.kill()
        reaper.join(timeout=10)
        other.wait(timeout=10)


def test_kv_estimate_cli(embedded_model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert lorastack_main(["kv-estimate", "--model", str(embedded_model)]) == 0
    out = capsys.readouterr().out
    assert "KV bytes/token: 46,080" in out
    assert "capacity: 23,296 tokens (182 blocks of 128 tokens)" in out
    assert "max concurrency at 2,048 tokens per request: 11.38x" in out
    argv = ["kv-estimate", "--model", str(embedded_model), "--gpu-mem-gib", "80",
            "--gpu-util", "0.9", "--max-model-len", "8192", "--max-num-seqs", "64"]  # fmt: skip
    assert lorastack_main(argv) == 0
    out = capsys.readouterr().out
    for flag in ("--gpu-memory-utilization", "--max-model-len", "--max-num-seqs"):
        assert f"  {flag}" in out


def test_cli_errors_are_exit_codes_not_tracebacks(
    tmp_path: Path, home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert lorastack_main(["serve", str(tmp_path / "missing.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert lorastack_main(["kv-estimate", "--model", "no/such:1"]) == 2
    assert "lorastack store ls no/such" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        lorastack_main(["kv-estimate", "--model", "x", "--gpu-util", "1.5"])
    assert "must be in (0, 1]" in capsys.readouterr().err


def test_vllm_s_refusals_carry_its_own_message() -> None:
    with FakeServer() as fake:
        load_lora(fake.base_url, "chat", Path("/adapters/chat"))
        with pytest.raises(EngineFailed) as e:
            load_lora(fake.base_url, "chat", Path("/adapters/chat"))
        assert e.value.message == (
            "vLLM refused to load chat (400): The lora adapter 'chat' has already been loaded."
        )
        unload_lora(fake.base_url, "chat")
        with pytest.raises(EngineFailed) as e:
            unload_lora(fake.base_url, "chat")
        assert e.value.message.endswith("(404): The lora adapter 'chat' cannot be found.")


def test_the_serve_settings_reach_the_engine_and_the_kv_estimate(tmp_path: Path) -> None:
    from inference.kv_cache import KvSetup

    s = build_settings(
        home=tmp_path, model="m:1", port=8100, host="0.0.0.0", max_model_len=4096,
        max_num_seqs=16, kv_cache_gib=3.0, gpu_memory_utilization=0.8, gpu_kv_cache_gib=5.0,
        enable_lora=True, max_lora_rank=32, max_loras=4, kv_cache_dtype="fp8",
        gpu_overhead_gib=1.5, typical_request_tokens=512, vllm_api_key="k" * 32,
    )  # fmt: skip
    spec = EngineSpec.from_settings(
        s, model_dir=tmp_path, dtype="bfloat16", platform="cuda", extra_args=["--x"]
    )
    assert (spec.port, spec.host, spec.max_model_len, spec.max_num_seqs) == (
        8100, "0.0.0.0", 4096, 16
    )  # fmt: skip
    assert (spec.kv_cache_gib, spec.gpu_memory_utilization, spec.gpu_kv_cache_gib) == (3, 0.8, 5)
    assert (spec.enable_lora, spec.max_lora_rank, spec.max_loras) == (True, 32, 4)
    assert (spec.dtype, spec.platform, spec.extra_args, spec.api_key) == (
        "bfloat16", "cuda", ("--x",), "k" * 32
    )  # fmt: skip
    assert spec.workdir == tmp_path / "serve"
    kv = KvSetup.from_settings(s, platform="cuda", dtype="bfloat16", gpu_mem_gib=80.0)
    assert kv == KvSetup(
        platform="cuda", max_model_len=4096, max_num_seqs=16, dtype="bfloat16", kv_dtype="fp8",
        kv_cache_gib=3.0, gpu_mem_gib=80.0, gpu_util=0.8, gpu_kv_cache_gib=5.0, overhead_gib=1.5,
        typical_tokens=512,
    )  # fmt: skip
