"""The processes and measurements around bench/gateway/gateway_latency.py: the fake vLLM
of the tests, the gateway and the nginx peer as processes of their own (pinned to CPUs with
taskset's list syntax), waiting until they answer, the gateway's state (RSS, connections,
in-flight gauge, a /metrics excerpt), and the percentile and "added" arithmetic. The
streaming client and the load loops stay in the script.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parents[2]
# the fake vLLM of the tests, as a process of its own
FAKE = [sys.executable, "-m", "lorastack_testing.fake_vllm"]


def cpu_set(spec: str) -> set[int]:
    """CPUs in taskset's list syntax ("2", "4-5", "0,6-7") as a set."""
    cpus: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.strip().partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def pinned(spec: str | None) -> Any:
    """A `preexec_fn` that pins the child to `spec` before it runs (None: no pinning)."""
    if spec is None:
        return None
    cpus = cpu_set(spec)
    return lambda: os.sched_setaffinity(0, cpus)


NGINX_CONF = """
worker_processes 1;
pid {tmp}/nginx.pid;
events {{ worker_connections 8192; }}
http {{
    access_log off;
    client_body_temp_path {tmp}/body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;  # all five here: a bare nginx binary (no package,
    uwsgi_temp_path {tmp}/uwsgi;      # as carried to the GPU machine) has no /var/lib/nginx
    scgi_temp_path {tmp}/scgi;
    upstream fake {{ server 127.0.0.1:{upstream}; keepalive 1024; }}
    server {{
        listen 127.0.0.1:{port} backlog=4096;
        location / {{
            proxy_pass http://fake;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_request_buffering off;
        }}
    }}
}}
"""


def start_nginx(upstream: int, port: int, pin: str | None) -> subprocess.Popen[bytes]:
    """nginx as a plain streaming reverse proxy to the fake (the `--peer-nginx` peer)."""
    exe = shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if Path(p).exists()), None
    )
    if exe is None:
        sys.exit("--peer-nginx needs nginx on PATH (Debian: apt-get install nginx)")
    tmp = Path(tempfile.mkdtemp(prefix="bench-nginx-"))
    (tmp / "nginx.conf").write_text(NGINX_CONF.format(tmp=tmp, upstream=upstream, port=port))
    cmd = [exe, "-p", str(tmp), "-c", str(tmp / "nginx.conf"), "-e", str(tmp / "error.log")]
    return subprocess.Popen([*cmd, "-g", "daemon off;"], preexec_fn=pinned(pin))


def start_fake(
    port: int, tokens: int, pace: float, env: dict[str, str], pin: str | None
) -> subprocess.Popen[bytes]:
    """The fake vLLM: `tokens` per answer, `pace` seconds apart."""
    cmd = [*FAKE, "--port", str(port), "--tokens", str(tokens), "--pace", str(pace)]
    # its READY line goes to stderr: stdout is the result JSON
    return subprocess.Popen(cmd, env=env, stdout=sys.stderr, preexec_fn=pinned(pin))


def start_gateway(
    port: int,
    upstream: int,
    tokenizer: str,
    env: dict[str, str],
    pin: str | None,
    *,
    tokenizers: dict[str, str] | None = None,
    upstreams: list[int] | None = None,
) -> subprocess.Popen[bytes]:
    """`lorastack gateway` (one uvicorn worker, or `LORASTACK_WORKERS` in `env`) in front
    of the fake, counting tokens with the `tokenizer` folder; admission lets every stream
    of the bench wait. `tokenizers` (model -> folder) replaces the one mapping;
    `upstreams` are more fakes behind it."""
    gw_env = dict(
        env,
        LORASTACK_TOKENIZERS=json.dumps(tokenizers or {"smollm2": tokenizer}),
        LORASTACK_ADMIT_MAX_WAITING="100000",
    )
    cmd = [sys.executable, "-m", "lorastack.cli", "gateway", "--port", str(port)]
    for one in (upstream, *(upstreams or [])):
        cmd += ["--backend", f"http://127.0.0.1:{one}"]
    return subprocess.Popen(cmd, env=gw_env, preexec_fn=pinned(pin))


def cpu_times(proc: psutil.Process) -> tuple[float, float]:
    """(user, system) CPU seconds of `proc` and its live children (the workers of
    `lorastack gateway --workers N`)."""
    each = process_cpu(proc).values()
    return sum(t[0] for t in each), sum(t[1] for t in each)


def cores_busy(
    before: dict[int, tuple[float, float]], after: dict[int, tuple[float, float]], wall: float
) -> list[float]:
    """Each process's CPU over `wall` seconds (1.0: one core all the time), from two
    `process_cpu` readings: the parent first, then the workers; one that is no longer
    there counts from 0."""
    return [round((sum(after[pid]) - sum(before.get(pid, (0.0, 0.0)))) / wall, 2) for pid in after]


def process_cpu(proc: psutil.Process) -> dict[int, tuple[float, float]]:
    """(user, system) CPU seconds of `proc` and of each of its live children, by pid."""
    out = {}
    for p in (proc, *proc.children(recursive=True)):
        try:
            t = p.cpu_times()
        except psutil.NoSuchProcess:
            continue
        out[p.pid] = (t.user, t.system)
    return out


def wait_http(port: int, path: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
                if b" 200 " in s.recv(100):
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"nothing answered 200 on :{port}{path}")


def added(via: dict[str, Any], direct: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """What a path adds to the direct one: `<prefix>ttft_p50_added_ms` and so on."""
    keys = ("ttft_p50_ms", "ttft_p99_ms", "e2e_p50_ms", "e2e_p99_ms")
    return {prefix + k.replace("_ms", "_added_ms"): round(via[k] - direct[k], 3) for k in keys}


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q / 100 * (len(s) - 1)))]


def gateway_state(proc: psutil.Process, port: int) -> dict[str, Any]:
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        raw = b""
        while chunk := s.recv(65536):
            raw += chunk
    text = raw.decode()
    m = re.search(r"^lorastack_gateway_inflight_requests (\S+)$", text, re.M)
    conns = [c for c in proc.net_connections(kind="tcp") if c.status == psutil.CONN_ESTABLISHED]
    return {
        "rss_mib": round(proc.memory_info().rss / 2**20, 1),
        "established_tcp": len(conns),
        "inflight_gauge": float(m.group(1)) if m else None,
        "open_fds": proc.num_fds(),
    }


def metrics_excerpt(port: int) -> str:
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        raw = b""
        while chunk := s.recv(65536):
            raw += chunk
    keep = ("inflight", "backend_", "rejections_total", "_count", "_sum", "upstream_errors")
    lines = raw.decode().split("\r\n\r\n", 1)[1].splitlines()
    return "\n".join(ln for ln in lines if not ln.startswith("#") and any(k in ln for k in keep))


def chat_bodies(long_chars: int) -> tuple[bytes, bytes]:
    """The streamed request of every point (a short chat, up to 64 tokens) and the long
    prompt of `--long-prompt-streams` (`long_chars` characters, some of them non-ASCII)."""
    body = json.dumps(
        {
            "model": "smollm2",
            "messages": [
                {"role": "system", "content": "You are a concise assistant."},
                {"role": "user", "content": "Explain in two sentences what a KV cache is."},
            ],
            "max_tokens": 64,
            "stream": True,
        }
    ).encode()
    sentence = "The quick brown fox jumps over the lazy dog, naïve café 東京. "
    long_text = (sentence * (long_chars // len(sentence) + 1))[:long_chars]
    long_body = json.dumps(
        {
            "model": "smollm2",
            "messages": [{"role": "user", "content": long_text}],
            "max_tokens": 16,
            "stream": True,
        }
    ).encode()
    return body, long_body


def thread_siblings() -> list[str]:
    """The CPUs that share a physical core, one entry a core ("0,8": two hyperthreads):
    CPUs pinned apart may still share a core's execution units."""
    cpus = Path("/sys/devices/system/cpu").glob("cpu[0-9]*/topology/thread_siblings_list")
    return sorted({f.read_text().strip() for f in cpus}, key=lambda s: int(re.split("[,-]", s)[0]))


def machine(gateway: str | None, upstream: str | None, client: str | None) -> dict[str, Any]:
    """The machine a result was measured on, and the CPUs each process was pinned to."""
    return {
        "cpus": os.cpu_count(),
        "cpu": platform.processor() or platform.machine(),
        "thread_siblings": thread_siblings(),
        "python": platform.python_version(),
        "pinned": {"gateway": gateway, "upstream": upstream, "client": client},
        "load_avg_at_start": os.getloadavg(),
    }
