"""What one large request body costs everyone else's streams: the worst time to first
event of small concurrent streams while the gateway handles a ~4 MiB body whose bulk is a
`tools` array, against the same streams with nothing large in flight.

Starts two fake vLLMs of the tests and one gateway per arm (`--arm NAME=PYTHONPATH`,
e.g. the parent commit's src folders from a `git archive`, and this checkout's), every
gateway in front of both fakes and pinned to the same CPU. The small streams go to the
`smollm2` fake; the large bodies to models served by the other fake (niced to 19), so
that parsing 4 MiB there does not stall the small streams' backend. The large bodies:

- `ignores-tools`: model `big-plain`, SmolLM2's own template, which does not render `tools`:
  the body is read, parsed and validated, the prompt is short, and it is forwarded;
- `renders-tools`: model `big-tools`, the same tokenizer with a template that writes every
  tool as JSON (as Qwen's and Llama 3.1's do): the ~4 M characters are rendered and
  counted, and the request is refused with 400 (over max_model_len 8192).

Each round drives each arm in turn (the order alternates: A B, B A, ...): small streamed
chats (`--tokens` tokens, `--pace` s apart) start `--rate` times a second on kept-alive
connections, whatever the others are doing (an open loop: a stall of the gateway's loop
delays every stream that starts during it, where a closed loop of workers would mostly
find them mid-stream). After `--idle` seconds of that, one large body of each kind is sent
from a thread (its own connection, `Connection: close`), one after the other, with
`--settle` seconds between. A small stream is "during" a large body when its wait for the
first event overlaps the large request, from its first byte sent to its last byte
received. Per arm, round and kind: the worst first-event time of the streams during it,
and the idle median and worst over the `--idle` seconds before; `extra` = worst during -
idle median. The result JSON (stdout) has every round and the medians over rounds.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/gateway/large_body.py \
        --tokenizer .cache/test-home/models/smollm2-<sha> \
        --arm old=OLD_SRC_DIRS --arm new=NEW_SRC_DIRS [--rounds 6] \
        --pin-gateway 0 --pin-upstream 1 --pin-client 1 > result.json

Without `--arm`, one arm, `checkout`, runs this checkout's src folders.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from lorastack_testing.net import free_port

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gateway_latency import stream_once
from harness import (
    FAKE,
    REPO,
    chat_bodies,
    cpu_set,
    machine,
    pct,
    start_fake,
    start_gateway,
    wait_http,
)

LIMIT = 4 * 1024 * 1024  # bytes: the gateway's default max_body_bytes
# a template that writes every tool as JSON in the system turn, then SmolLM2's own
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nYou may call these tools:\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
)


def tool(i: int) -> dict[str, Any]:
    """An OpenAI function tool with a JSON schema of the usual shape (~700 bytes)."""
    return {
        "type": "function",
        "function": {
            "name": f"lookup_{i}",
            "description": "Look up the current weather for a city and return it in the "
            "unit asked for, with the wind and the chance of rain.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "the city's name, e.g. Paris"},
                    "country": {"type": "string", "description": "ISO 3166 code, e.g. FR"},
                    "unit": {
                        "type": "string",
                        "enum": ["celsius", "fahrenheit"],
                        "description": "temperature unit",
                    },
                    "hourly": {"type": "boolean", "description": "hour by hour"},
                },
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }


def large_body(model: str, limit: int = LIMIT) -> bytes:
    """A streamed chat of one short message and as many tools as fit in `limit` bytes."""
    head = {"model": model, "messages": [{"role": "user", "content": "What is it like?"}]}
    head.update(max_tokens=16, stream=True)
    one = len(json.dumps(tool(0))) + 2
    tools = [tool(i) for i in range((limit - 200) // one)]
    raw = json.dumps({**head, "tools": tools}).encode()
    while len(raw) > limit:
        tools.pop()
        raw = json.dumps({**head, "tools": tools}).encode()
    return raw


def tools_tokenizer(tokenizer: str) -> str:
    """A copy of the tokenizer folder's tokenizer files whose template renders `tools`."""
    out = Path(tempfile.mkdtemp(prefix="bench-tools-tok-"))
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        if (Path(tokenizer) / name).is_file():
            shutil.copy(Path(tokenizer) / name, out / name)
    template = (Path(tokenizer) / "chat_template.jinja").read_text()
    (out / "chat_template.jinja").write_text(TOOLS_TEMPLATE + template)
    return str(out)


def send_large(port: int, body: bytes) -> dict[str, Any]:
    """POST `body` on a connection of its own (blocking; run it in a thread): its status and
    when it went out and when its answer ended (time.perf_counter, seconds)."""
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
    )
    with socket.create_connection(("127.0.0.1", port)) as s:
        t0 = time.perf_counter()
        s.sendall(head + body)
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
        t1 = time.perf_counter()
    status = int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else 0
    return {"status": status, "t0": t0, "t1": t1, "ms": round((t1 - t0) * 1000, 1)}


async def measure(
    port: int,
    small: bytes,
    larges: dict[str, bytes],
    *,
    rate: float,
    idle: float,
    settle: float,
) -> dict[str, Any]:
    """One arm's round: small streams arriving `rate` a second throughout (an open loop: a
    stall delays the streams that arrive during it, whatever the others are doing); idle,
    then each large body in turn."""
    samples: list[tuple[float, float]] = []  # (start, first event), perf_counter seconds
    idle_conns: list[dict[str, Any]] = []  # kept-alive connections no stream is using
    tasks: set[asyncio.Task[None]] = set()
    errors = 0

    async def one() -> None:
        nonlocal errors
        pool = idle_conns.pop() if idle_conns else {}
        t = time.perf_counter()
        try:
            ttfe, _ = await stream_once(port, small, pool=pool)
            samples.append((t, t + ttfe))
            idle_conns.append(pool)
        except (OSError, RuntimeError, asyncio.IncompleteReadError):
            errors += 1

    stop = False

    async def arrivals() -> None:
        due = time.perf_counter()
        while not stop:
            due += 1 / rate
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            task = asyncio.ensure_future(one())
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    loop = asyncio.get_running_loop()
    arriving = asyncio.ensure_future(arrivals())
    await asyncio.sleep(0.5)
    idle_from = time.perf_counter()
    await asyncio.sleep(idle)
    idle_to = time.perf_counter()
    sent: dict[str, dict[str, Any]] = {}
    for kind, body in larges.items():
        sent[kind] = await loop.run_in_executor(None, send_large, port, body)
        await asyncio.sleep(settle)
    stop = True
    await arriving
    await asyncio.gather(*tasks)
    for pool in idle_conns:
        pool["rw"][1].close()

    ms = 1000.0
    idle_ttfe = [(e - s) * ms for s, e in samples if idle_from <= s and e <= idle_to]
    row: dict[str, Any] = {
        "idle": {
            "streams": len(idle_ttfe),
            "median_ms": round(statistics.median(idle_ttfe), 3),
            "p99_ms": round(pct(idle_ttfe, 99), 3),
            "worst_ms": round(max(idle_ttfe), 3),
        },
        "errors": errors,
    }
    for kind, r in sent.items():
        during = [(e - s) * ms for s, e in samples if s < r["t1"] and e > r["t0"]]
        worst = max(during) if during else None
        row[kind] = {
            "status": r["status"],
            "large_ms": r["ms"],
            "streams_during": len(during),
            "worst_ms": round(worst, 3) if worst is not None else None,
            "extra_ms": round(worst - row["idle"]["median_ms"], 3) if worst is not None else None,
        }
    return row


def start_large_fake(port: int, env: dict[str, str], pin: str | None) -> subprocess.Popen[bytes]:
    """The fake that answers the large bodies, at nice 19: its own parse of 4 MiB waits for
    the CPU instead of taking it from the small streams' fake and the client."""
    cpus = cpu_set(pin) if pin is not None else None

    def setup() -> None:
        if cpus is not None:
            os.sched_setaffinity(0, cpus)
        os.nice(19)

    cmd = [*FAKE, "--port", str(port), "--tokens", "4", "--model", "big-plain", "big-tools"]
    return subprocess.Popen(cmd, env=env, stdout=sys.stderr, preexec_fn=setup)


def src_dirs(root: Path) -> str:
    """This checkout's src folders as a PYTHONPATH."""
    layers = ("libs", "services", "apps", "tools")
    return ":".join(str(p) for layer in layers for p in sorted((root / layer).glob("*/src")))


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--tokenizer", required=True, help="HF folder of SmolLM2")
    p.add_argument(
        "--arm",
        action="append",
        metavar="NAME=PYTHONPATH",
        help="a gateway version: its name and the src folders it imports (repeat)",
    )
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--rate", type=float, default=200.0, help="small streams started a second")
    p.add_argument("--idle", type=float, default=3.0, help="seconds of small streams alone")
    p.add_argument("--settle", type=float, default=0.5, help="seconds after each large body")
    p.add_argument("--tokens", type=int, default=8, help="tokens per small answer")
    p.add_argument("--pace", type=float, default=0.005, help="seconds between tokens")
    for who in ("gateway", "upstream", "client"):
        p.add_argument(f"--pin-{who}", metavar="CPUS", help=f"run the {who} on these CPUs")
    p.add_argument("--note", default="", help="a line on the machine, kept in the result")
    a = p.parse_args()
    commit = subprocess.run(  # the checkout as the run starts
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO
    ).stdout.strip()
    arms = dict(x.split("=", 1) for x in a.arm) if a.arm else {"checkout": src_dirs(REPO)}
    host = {**machine(a.pin_gateway, a.pin_upstream, a.pin_client), "note": a.note}
    if a.pin_client is not None:
        os.sched_setaffinity(0, cpu_set(a.pin_client))

    import uvloop

    env = dict(os.environ, HF_HUB_OFFLINE="1", LORASTACK_HOME=str(REPO / ".cache" / "bench-home"))
    env["PYTHONPATH"] = src_dirs(REPO)  # the fakes: this checkout's
    small_port, large_port = free_port(), free_port()
    fakes = [
        start_fake(small_port, a.tokens, a.pace, env, a.pin_upstream),
        start_large_fake(large_port, env, a.pin_upstream),
    ]
    tokenizers = {"smollm2": a.tokenizer, "big-plain": a.tokenizer}
    tokenizers["big-tools"] = tools_tokenizer(a.tokenizer)
    ports = {arm: free_port() for arm in arms}
    gws = {
        arm: start_gateway(
            ports[arm],
            small_port,
            a.tokenizer,
            dict(env, PYTHONPATH=path),
            a.pin_gateway,
            tokenizers=tokenizers,
            upstreams=[large_port],
        )
        for arm, path in arms.items()
    }
    try:
        for port in (small_port, large_port):
            wait_http(port, "/v1/models")
        for port in ports.values():
            wait_http(port, "/ready")
        small, _ = chat_bodies(0)
        larges = {
            "ignores-tools": large_body("big-plain"),
            "renders-tools": large_body("big-tools"),
        }
        opts = dict(rate=a.rate, idle=a.idle, settle=a.settle)
        loop = uvloop.new_event_loop()
        asyncio.set_event_loop(loop)
        for port in ports.values():  # warm-up: every path once, the large ones too
            loop.run_until_complete(measure(port, small, larges, **{**opts, "idle": 1.0}))
        rounds: list[dict[str, Any]] = []
        names = list(arms)
        for i in range(a.rounds):
            order = names if i % 2 == 0 else names[::-1]
            row: dict[str, Any] = {"round": i + 1, "order": order, "load_avg": os.getloadavg()}
            for arm in order:
                row[arm] = loop.run_until_complete(measure(ports[arm], small, larges, **opts))
            rounds.append(row)
            print(json.dumps(row), file=sys.stderr)

        def summary(arm: str) -> dict[str, Any]:
            """Medians over the rounds (and the range of the one the goal reads)."""

            def median(kind: str, key: str) -> float:
                return round(statistics.median(r[arm][kind][key] for r in rounds), 3)

            idle = [r[arm]["idle"]["median_ms"] for r in rounds]
            out: dict[str, Any] = {
                "idle": {
                    "median_ms_median": median("idle", "median_ms"),
                    "median_ms_range": [min(idle), max(idle)],
                    "worst_ms_median": median("idle", "worst_ms"),
                }
            }
            for kind in larges:
                extra = [r[arm][kind]["extra_ms"] for r in rounds]
                out[kind] = {
                    "extra_ms_median": median(kind, "extra_ms"),
                    "extra_ms_range": [min(extra), max(extra)],
                    "worst_ms_median": median(kind, "worst_ms"),
                    "large_ms_median": median(kind, "large_ms"),
                }
            return out

        result = {
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "commit": commit,
            "machine": host,
            "arms": arms,
            "workload": {
                "small_streams_per_s": a.rate,
                "tokens_per_small_answer": a.tokens,
                "pace_s": a.pace,
                "idle_s": a.idle,
                "large_body_bytes": {k: len(v) for k, v in larges.items()},
                "tools_per_large_body": larges["ignores-tools"].count(b'"type": "function"'),
                "client_connections": "kept alive per small-stream worker",
            },
            "summary": {arm: summary(arm) for arm in arms},
            "rounds": rounds,
        }
        result["machine"]["load_avg_at_end"] = os.getloadavg()
        print(json.dumps(result, indent=2))
    finally:
        for proc in (*gws.values(), *fakes):
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    main()
