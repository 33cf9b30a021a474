"""`lorastack up | down | status`: the long-lived services as local processes.

The same entry points as compose: `lorastack serve CONFIG` (the inference supervisor,
which runs vLLM) and `lorastack gateway`, each configured through its environment, built
from the service's own settings class (`child_env`), so a renamed or invalid setting fails
here, before anything starts. Each process runs in its own session (so `down`
stops vLLM's engine processes too), logs to HOME/logs/<name>.log and leaves its pid, create
time and command line in HOME/run/<name>.pid (`lorastack.pidfile`): `down`, `up` and `status`
act on that pid only while it is still the process we started; a stale or reused pid is
reported, its file removed, and nothing is signalled. `up` starts the services together
and returns once each answers /ready.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.settings import GatewaySettings
from inference.settings import InferenceSettings
from lorastack import pidfile as pidfile_mod
from lorastack.errors import NotFound, Refused
from lorastack.parity import describe
from lorastack.settings import CommonSettings, child_env

# the services' own defaults
VLLM_PORT: int = InferenceSettings.model_fields["port"].default  # OpenAI API of vLLM
# /ready /status /metrics /admin of the inference supervisor
SUPERVISOR_PORT: int = InferenceSettings.model_fields["supervisor_port"].default
GATEWAY_PORT: int = GatewaySettings.model_fields["port"].default


@dataclass(frozen=True)
class Service:
    """One local service: its command, environment, readiness URL and URLs to show."""

    name: str
    argv: list[str]
    env: dict[str, str]
    ready_url: str
    urls: dict[str, str]
    ports: tuple[int, ...] = ()  # what it listens on (127.0.0.1)


def services(settings: CommonSettings, serve_config: Path, gateway_port: int) -> list[Service]:
    """The local stack's services (vLLM under its supervisor, then the gateway) with their
    commands and environments."""
    common = child_env(
        CommonSettings, home=settings.home, store_url=settings.resolved_store_url
    ) | {"HF_HUB_OFFLINE": "1"}
    cli = [sys.executable, "-m", "lorastack.cli"]
    inference = Service(
        name="inference",
        argv=[*cli, "serve", str(serve_config)],
        env=common | child_env(InferenceSettings, port=VLLM_PORT, supervisor_port=SUPERVISOR_PORT),
        ready_url=f"http://127.0.0.1:{SUPERVISOR_PORT}/ready",
        ports=(VLLM_PORT, SUPERVISOR_PORT),
        urls={
            "vLLM OpenAI API": f"http://127.0.0.1:{VLLM_PORT}/v1",
            "vLLM metrics": f"http://127.0.0.1:{VLLM_PORT}/metrics",
            "supervisor status": f"http://127.0.0.1:{SUPERVISOR_PORT}/status",
            "supervisor metrics": f"http://127.0.0.1:{SUPERVISOR_PORT}/metrics",
        },
    )
    gateway = Service(
        name="gateway",
        argv=[*cli, "gateway"],
        env=common
        | child_env(
            GatewaySettings,
            port=gateway_port,
            backends=[f"http://127.0.0.1:{VLLM_PORT}"],
            serve_config=serve_config.resolve(),  # served name -> store artifact (tokenizers)
        ),
        ready_url=f"http://127.0.0.1:{gateway_port}/ready",
        ports=(gateway_port,),
        urls={
            "gateway (OpenAI API)": f"http://127.0.0.1:{gateway_port}/v1",
            "gateway metrics": f"http://127.0.0.1:{gateway_port}/metrics",
        },
    )
    return [inference, gateway]


def _paths(settings: CommonSettings, name: str) -> tuple[Path, Path]:
    return settings.home / "run" / f"{name}.pid", settings.home / "logs" / f"{name}.log"


def _ours(pidfile: Path) -> pidfile_mod.Found:
    """The process the pid file names, if it is still the one we started; a stale file is
    removed and said so on stderr."""
    found = pidfile_mod.find_ours(pidfile)
    if found.problem:
        print(f"  {pidfile}: {found.problem}", file=sys.stderr, flush=True)
    return found


def is_ready(url: str, timeout: float = 2.0) -> bool:
    """Whether `url` answers 200 within `timeout` seconds."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def gave_up(url: str, timeout: float = 2.0) -> str:
    """The state a not-ready service says it will stay in ("refused": what it serves
    failed its parity check; "failed": vLLM kept dying of the same cause), else ""."""
    try:
        with urllib.request.urlopen(url, timeout=timeout):
            return ""
    except urllib.error.HTTPError as e:
        try:
            state = json.loads(e.read()).get("state", "")
        except (ValueError, AttributeError, OSError):
            return ""
        return str(state) if state in ("refused", "failed") else ""
    except (urllib.error.URLError, OSError):
        return ""


def parity_lines(supervisor_url: str) -> list[str]:
    """What the supervisor serves in which dtype, and each parity verdict, one line each
    (lorastack.parity); empty when the supervisor does not answer."""
    try:
        with urllib.request.urlopen(f"{supervisor_url}/status", timeout=10) as resp:
            body = json.loads(resp.read())
    except (urllib.error.URLError, OSError, ValueError):
        return []
    lines = []
    if dtype := body.get("dtype"):
        lines.append(f"served in {dtype['served']}: {dtype['why']}")
    for record in (body.get("parity") or {}).values():
        lines.append(describe(record))
        lines += [f"  {problem}" for problem in record.get("problems", [])]
    return lines


def tail(path: Path, n: int = 20) -> str:
    """The last `n` lines of a log file, or "(no log)"."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except FileNotFoundError:
        return "(no log)"


def port_taken(port: int) -> bool:
    """Whether something accepts connections on 127.0.0.1:`port`."""
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex(("127.0.0.1", port)) == 0


def launch(settings: CommonSettings, svc: Service) -> subprocess.Popen[bytes] | None:
    """Start the service's process; None when it already runs and answers /ready.

    Refused when another process holds one of its ports (the stack of another
    LORASTACK_HOME, a compose stack): its /ready would pass for this service's, and this
    home's commands would be served by that one's store and models."""
    pidfile, logfile = _paths(settings, svc.name)
    if (running := _ours(pidfile).process) is not None:
        pid = running.pid
        if is_ready(svc.ready_url):
            print(f"  {svc.name} already running (pid {pid})", flush=True)
            return None
        raise Refused(
            f"{svc.name} runs (pid {pid}) but is not ready",
            f"wait, or 'lorastack down' first; log: {logfile}",
        )
    if taken := [str(p) for p in svc.ports if port_taken(p)]:
        raise Refused(
            f"{svc.name} cannot start: {'ports' if len(taken) > 1 else 'port'}"
            f" {', '.join(taken)} of 127.0.0.1 {'are' if len(taken) > 1 else 'is'} taken by"
            f" a process this LORASTACK_HOME ({settings.home}) did not start",
            "stop it ('lorastack down' with the LORASTACK_HOME that started it, or"
            " 'docker compose down'), or give the gateway another --gateway-port",
        )
    pidfile.parent.mkdir(parents=True, exist_ok=True)
    logfile.parent.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORASTACK_")} | svc.env
    with logfile.open("ab") as log:
        proc = subprocess.Popen(
            svc.argv,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    pidfile_mod.write_pidfile(pidfile, proc.pid)  # None when it already exited: see below
    print(f"  {svc.name}: pid {proc.pid}, log {logfile}", flush=True)
    return proc


def wait_ready(
    settings: CommonSettings,
    svc: Service,
    proc: subprocess.Popen[bytes],
    timeout_s: float,
    started: float,
) -> None:
    """Block until the launched service answers /ready (`started`: its launch, monotonic);
    stop it and raise Refused, with its log's tail, when it exits, gives up or times out."""
    pidfile, logfile = _paths(settings, svc.name)
    last_note = started
    while not is_ready(svc.ready_url):
        if proc.poll() is not None:
            pidfile.unlink(missing_ok=True)
            raise Refused(
                f"{svc.name} exited with code {proc.returncode} before it was ready:\n"
                f"{tail(logfile)}",
                f"the full log is {logfile}",
            )
        if state := gave_up(svc.ready_url):
            stop(settings, svc.name)
            raise Refused(
                f"{svc.name} stopped trying ({state}):\n{tail(logfile)}",
                f"the full log is {logfile}",
            )
        now = time.monotonic()
        if now - started > timeout_s:
            stop(settings, svc.name)
            raise Refused(
                f"{svc.name} was not ready after {timeout_s:.0f} s:\n{tail(logfile)}",
                f"the full log is {logfile}",
            )
        if now - last_note >= 15:
            print(f"  ... waiting for {svc.name} ({now - started:.0f} s)", flush=True)
            last_note = now
        time.sleep(1)
    print(f"  {svc.name} ready after {time.monotonic() - started:.0f} s", flush=True)


def _get_json(url: str) -> Any:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return json.loads(resp.read())
    except (urllib.error.URLError, OSError, ValueError):
        return None


def wait_listed(svcs: list[Service], timeout_s: float = 30.0) -> None:
    """Block until the gateway lists every adapter the supervisor serves. The supervisor
    says ready once each adapter passed its parity check and was loaded under its name; the
    gateway sees it at its next scrape of vLLM's /v1/models (scrape_interval_s later). A
    gateway that wants a key for /v1/models is not waited for."""
    supervisor, gateway = (svc.ready_url.removesuffix("/ready") for svc in svcs)
    status = _get_json(f"{supervisor}/status") or {}
    wanted = {a["served_name"] for a in status.get("adapters", [])}
    deadline = time.monotonic() + timeout_s
    while wanted and time.monotonic() < deadline:
        listed = _get_json(f"{gateway}/v1/models")
        if listed is None or wanted <= {m.get("id") for m in listed.get("data", [])}:
            return
        time.sleep(0.5)


def stop(settings: CommonSettings, name: str, grace_s: float = 20.0) -> bool:
    """Stop the service's process group if its pid file names a process we started."""
    pidfile, _ = _paths(settings, name)
    found = _ours(pidfile)
    pidfile.unlink(missing_ok=True)
    if found.process is None:
        return False
    pidfile_mod.stop_group(found, grace_s)
    return True


def up(
    settings: CommonSettings,
    serve_config: Path,
    gateway_port: int = GATEWAY_PORT,
    timeout_s: float = 900,
) -> list[Service]:
    """Start the services not yet running and wait until each answers /ready.

    Raises NotFound without `serve_config`, and Refused when a service fails to come up
    (what this call started is stopped again)."""
    if not serve_config.is_file():
        raise NotFound(
            f"serve config {serve_config} does not exist",
            "give a serve YAML (services/inference/README.md), or run 'lorastack demo'",
        )
    svcs = services(settings, serve_config, gateway_port)
    # all at once: the gateway starts (imports, tokenizers) while vLLM loads, and answers
    # /ready once its backend does
    started = time.monotonic()
    launched: list[tuple[Service, subprocess.Popen[bytes]]] = []
    try:
        for svc in svcs:
            if (proc := launch(settings, svc)) is not None:
                launched.append((svc, proc))
        for svc, proc in launched:
            wait_ready(settings, svc, proc, timeout_s, started)
        if launched:
            wait_listed(svcs)
    except Refused:
        for svc, _ in launched:  # nothing this call started is left half-up
            stop(settings, svc.name)
        raise
    return svcs


def status(settings: CommonSettings, gateway_port: int) -> list[dict[str, Any]]:
    """Per service: its pid (None when not running), readiness, log path and URLs."""
    rows = []
    for svc in services(settings, Path("-"), gateway_port):
        pidfile, logfile = _paths(settings, svc.name)
        process = _ours(pidfile).process
        pid = process.pid if process is not None else None
        rows.append(
            {
                "service": svc.name,
                "pid": pid,
                "ready": pid is not None and is_ready(svc.ready_url),
                "log": str(logfile),
                "urls": svc.urls,
            }
        )
    return rows


def cmd_up(args: argparse.Namespace) -> int:
    settings = CommonSettings()
    config = Path(args.serve_config or settings.home / "demo" / "serve.yaml")
    svcs = up(settings, config, args.gateway_port, args.timeout)
    for svc in svcs:
        for label, url in svc.urls.items():
            print(f"  {label:22} {url}")
    print("stop with: lorastack down")
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    settings = CommonSettings()
    for name in ("gateway", "inference"):
        print(f"{name}: {'stopped' if stop(settings, name) else 'not running'}")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    rows = status(CommonSettings(), args.gateway_port)
    for r in rows:
        state = "ready" if r["ready"] else ("starting/unready" if r["pid"] else "stopped")
        print(f"{r['service']:10} {state:17} pid {r['pid'] or '-':>7}  log {r['log']}")
        if r["pid"]:
            for label, url in r["urls"].items():
                print(f"{'':12}{label:22} {url}")
        if r["service"] == "inference" and r["pid"]:
            for line in parity_lines(f"http://127.0.0.1:{SUPERVISOR_PORT}"):
                print(f"{'':12}{line}")
    return 0 if all(r["ready"] for r in rows) else 1


def register(sub: Any) -> None:
    p = sub.add_parser("up", help="start inference (vLLM) and the gateway as local processes")
    p.add_argument(
        "--serve-config",
        help="serve YAML (e.g. apps/lorastack/serve.yaml); default HOME/demo/serve.yaml, "
        "the one `lorastack demo` wrote",
    )
    p.add_argument("--gateway-port", type=int, default=GATEWAY_PORT)
    p.add_argument("--timeout", type=float, default=900, help="seconds to wait for each /ready")
    p.set_defaults(handler=cmd_up)
    p = sub.add_parser("down", help="stop the local services")
    p.set_defaults(handler=cmd_down)
    p = sub.add_parser("status", help="show the local services, their URLs and logs")
    p.add_argument("--gateway-port", type=int, default=GATEWAY_PORT)
    p.set_defaults(handler=cmd_status)
