"""`lorastack gateway --workers N`: the counts the workers share (`shared_claims.py`) in
one process, then two real worker processes behind the fake vLLM, each request sent on
a connection the test knows the worker of (read from the workers' sockets), so what
crosses workers is chosen, not left to the kernel."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import http.client
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_gateway_proxy import ADMIN_KEY, CHAT, METRICS_KEY, metric

from gateway import processes
from gateway.admission import Admission
from gateway.backends import Backends
from gateway.errors import NoKvRoom
from gateway.keys import KeyEntry, KeysFile, hash_secret, save_keys
from gateway.metrics import GatewayMetrics
from gateway.routing import RouteRequest, Thresholds, Weights
from gateway.scrape import BackendMetrics, ModelInfo
from gateway.settings import GatewaySettings
from gateway.shared_claims import LockWatch, SharedInflight
from gateway.tokens import TokenizerCache
from gateway.upstream import Upstream
from lorastack_testing.dns_server import DnsServer
from lorastack_testing.fake_vllm import FakeState, serve_fake
from lorastack_testing.net import free_port, wait_for
from lorastack_testing.redis_server import require_redis_server, serve_redis

FREE_KEY = "sk-free-" + "0123456789abcdef" * 2
LIMITED_KEY = "sk-limited-" + "0123456789abcdef" * 2
BUDGET_KEY = "sk-budget-" + "0123456789abcdef" * 2
MAX_TOKENS = 1000
# 189 blocks of 16 tokens: room for two claims of prompt (1..504 tokens: the gateway may
# claim an upper bound of this short chat) + MAX_TOKENS, never three (the null block aside)
BLOCKS, B = 189, 16
BOUND = 504


# --- the shared counts, in one process ----------------------------------------------
def test_two_workers_counts_add_up_and_a_cleared_slot_drops_only_its_own(tmp_path) -> None:
    path = tmp_path / "claims"
    SharedInflight.create(path, 2)
    one, two = SharedInflight(path, 0), SharedInflight(path, 1)
    one.add("http://a", 1, 320)
    two.add("http://a", 1, 160)
    two.add("http://b", 1, 16)
    assert one.counts == {"http://a": 2, "http://b": 1}
    assert one.tokens == {"http://a": 480, "http://b": 16}
    one.clear_slot(1)  # the parent, once worker 1 died
    assert two.counts == {"http://a": 1, "http://b": 0} and two.tokens["http://a"] == 320
    assert two.sent == {"http://a": 2, "http://b": 1}  # never cleared: scrapes compare it
    one.add("http://a", -1, -320)
    assert one.counts["http://a"] == 0 and one.tokens["http://a"] == 0


def test_forgotten_backends_free_their_entries_so_new_addresses_never_run_out(
    tmp_path,
) -> None:
    """Replicas found by DNS come and go with new addresses: a forgotten backend's entry is
    reused once no worker counts on it, and a worker holding a stale index reads again."""
    from gateway.shared_claims import MAX_BACKENDS

    path = tmp_path / "claims"
    SharedInflight.create(path, 2)
    one, two = SharedInflight(path, 0), SharedInflight(path, 1)
    two.add("http://keep", 1, 64)  # a live backend throughout
    for n in range(MAX_BACKENDS * 2):  # twice the table's entries, one replica at a time
        url = f"http://10.0.{n // 256}.{n % 256}:8000"
        one.add(url, 1, 32)
        two.add(url, 1, 16)
        one.forget(url)  # worker 1 still counts a request on it: kept
        assert two.counts[url] == 2
        one.add(url, -1, -32)
        two.add(url, -1, -16)
        two.forget(url)
        one.forget(url)
        assert url not in one.counts and url not in two.counts
    assert one.counts == {"http://keep": 1} and one.tokens == {"http://keep": 64}
    two.add("http://keep", -1, -64)
    assert two.counts == {"http://keep": 0}


def test_a_worker_that_dies_counting_on_a_forgotten_backend_leaks_no_entry(tmp_path) -> None:
    """Issue 58, finding 7: worker 1 forgets a drained replica while worker 2 still counts
    a request on it; worker 2 dies before its own forget. The parent's `clear_slot` frees
    the entry with the dead worker's counts, so replicas that come and go, each outliving
    a dying worker, never fill the table (before: full after MAX_BACKENDS of them)."""
    from gateway.shared_claims import MAX_BACKENDS

    path = tmp_path / "claims"
    SharedInflight.create(path, 2)
    parent, one = SharedInflight(path, 0), SharedInflight(path, 0)
    for n in range(MAX_BACKENDS * 2):
        two = SharedInflight(path, 1)  # a new worker in slot 1 each time
        url = f"http://10.1.{n // 256}.{n % 256}:8000"
        two.add(url, 1, 16)
        one.forget(url)  # drained as far as worker 1 knows: kept for worker 2's count
        assert one.counts[url] == 1
        two.close()  # worker 2 dies
        parent.clear_slot(1)
        assert url not in one.counts
    one.add("http://still", 1, 16)  # the table has room
    assert parent.counts == {"http://still": 1}


def test_the_admission_lines_are_one_line_per_backend_across_workers(tmp_path) -> None:
    """Tickets order the requests of every worker; a request looks for room only on the
    backends where no earlier ticket waits, whichever worker holds it (issue 58)."""
    path = tmp_path / "claims"
    SharedInflight.create(path, 2)
    one, two = SharedInflight(path, 0), SharedInflight(path, 1)
    a, b = "http://a", "http://b"

    async def scenario() -> None:
        first = one.join({a})
        second = two.join({a, b})
        third = one.join({b})
        assert one.waiting == two.waiting == 3
        assert one.blocked(None) == two.blocked(None) == {a, b}  # a newcomer: both taken
        assert one.blocked(first) == set()
        assert two.blocked(second) == {a}  # b is its to take: nobody came before it there
        assert one.blocked(third) == {a, b}  # second, in the other worker, waits on b first
        one.leave(first)
        assert two.blocked(second) == set() and one.blocked(third) == {a, b}
        two.leave(second)
        assert one.blocked(third) == set()
        one.leave(third)
        assert two.waiting == 0 and two.blocked(None) == set()

    asyncio.run(scenario())
    one.close()
    two.close()


def test_room_given_back_wakes_the_first_waiter_of_that_backend_in_another_worker(
    tmp_path,
) -> None:
    """No poll: a claim given back in one worker, or the first request leaving a line,
    wakes the worker whose request is next in that backend's line (one datagram), and
    nobody else."""
    path = tmp_path / "claims"
    SharedInflight.create(path, 2)
    one, two = SharedInflight(path, 0), SharedInflight(path, 1)
    a, b = "http://a", "http://b"

    async def scenario() -> None:
        one.add(a, 1, 64)
        one.add(b, 1, 64)
        on_a = two.join({a})
        on_b = two.join({b})
        one.add(b, -1, -64)  # room on b: only b's first waiter is woken
        # the wait only bounds a failure: the datagram is read by this loop's next turn
        await asyncio.wait_for(on_b.wait(), 10)
        assert not on_a.is_set()
        first = one.join({a})  # a later ticket: behind on_a
        two.leave(on_a)  # the first in a's line left: the next, in worker one, looks
        await asyncio.wait_for(first.wait(), 10)
        one.leave(first)
        two.leave(on_b)

    asyncio.run(scenario())
    one.close()
    two.close()


def test_a_pick_holds_every_workers_lock(tmp_path) -> None:
    path = tmp_path / "claims"
    SharedInflight.create(path, 2)
    one, two = SharedInflight(path, 0), SharedInflight(path, 1)
    # re-entered within a worker, and held against every other
    with one.exclusive(), one.exclusive(), pytest.raises(BlockingIOError):
        fcntl.flock(two._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    fcntl.flock(two._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free once the hold ends
    fcntl.flock(two._fd, fcntl.LOCK_UN)


def test_claimed_reads_one_backend_of_every_worker_even_one_registered_elsewhere(
    tmp_path,
) -> None:
    path = tmp_path / "claims"
    SharedInflight.create(path, 2)
    one, two = SharedInflight(path, 0), SharedInflight(path, 1)
    one.add("http://a", 1, 320)
    assert one.counts == {"http://a": 1}  # read once, before worker 2 registers http://b
    two.add("http://a", 1, 160)
    two.add("http://b", 1, 16)
    assert one.claimed("http://a") == (2, 480) and one.claimed("http://b") == (1, 16)
    assert one.counts == {"http://a": 2, "http://b": 1}  # the new entry is read too


class _RacingCount(SharedInflight):
    """Worker 1's counts, where worker 2 runs `race` just before worker 1 next takes the
    lock: after routing chose a backend without the lock, before the claim is counted."""

    race: Any = None

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        if self.race is not None and self._depth == 0:
            race, self.race = self.race, None
            race()
        with super().exclusive():
            yield


class _NoNetwork(Upstream):
    async def _attempt(
        self, backend: str, path: str, body: bytes, headers: Any, tokens: int = 0
    ) -> Any:  # type: ignore[override]
        return backend, tokens


def test_a_pick_made_without_the_lock_routes_again_once_another_worker_took_its_room(
    tmp_path,
) -> None:
    """Routing scores the backends without the workers' lock; under it the claim is
    confirmed: room another worker took meanwhile sends the request to the other backend,
    and with no room left anywhere it is refused, never over-admitted."""
    path = tmp_path / "claims"
    SharedInflight.create(path, 2)
    one, two = _RacingCount(path, 0), SharedInflight(path, 1)
    a, b = "http://a", "http://b"
    settings = GatewaySettings(backends=[a, b], kv_admit_wait_s=0)
    backends = Backends(settings, GatewayMetrics(), TokenizerCache(settings), None, inflight=one)  # type: ignore[arg-type]
    # usable KV (less vLLM's null block): a 320 tokens, b 176; 16 claimed on each
    for url, blocks in ((a, 21), (b, 12)):
        st = backends.states[url]
        st.up, st.models = True, {"m": ModelInfo("m", 4096, None, None)}
        st.metrics = BackendMetrics(kv_capacity_tokens=blocks * 16, block_size=16)
        one.add(url, 1, 16)
    upstream = _NoNetwork(settings, GatewayMetrics(), one)
    admission = Admission(settings, backends, upstream, Thresholds(), Weights())
    req = RouteRequest("m", sequences=(150,))  # a claim of 160 tokens: whole blocks

    def send() -> Any:
        return asyncio.run(admission.open(req, "/v1/chat/completions", b"{}", "rid"))

    # routing chooses a (a tie, broken by name); worker 2 then claims 160 of a's room
    one.race = lambda: two.add(a, 1, 160)
    assert send() == (b, 160)  # confirmed under the lock: a has 144 left, so b
    assert one.claimed(a) == (2, 176) and one.claimed(b) == (2, 176)  # b is full now
    two.add(a, -1, -160)  # a has room again, so routing chooses it; taken again meanwhile
    one.race = lambda: two.add(a, 1, 160)
    with pytest.raises(NoKvRoom):
        send()
    assert one.claimed(a) == (2, 176) and one.claimed(b) == (2, 176)


# a process that takes the lock of the shared counts, then stops itself while holding it
HOLD_AND_STOP = """
import os, signal, sys
from pathlib import Path
from gateway.shared_claims import SharedInflight

shared = SharedInflight(Path(sys.argv[1]), 1)
with shared.exclusive():
    os.kill(os.getpid(), signal.SIGSTOP)
"""


def test_a_worker_stopped_while_it_holds_the_lock_is_killed_and_the_others_go_on(
    tmp_path,
) -> None:
    """Issue 58: every worker takes the lock on its event loop, so one stopped while it
    holds it (SIGSTOP, a debugger, a frozen cgroup) stopped them all, for as long as it
    stayed stopped. The parent's lock watch kills it after LOCK_STALL_S; the kernel then
    drops its lock. (A worker killed while it holds the lock never blocked anyone: the
    kernel drops the lock of a dead process, shown here by the same kill.)"""
    path = tmp_path / "claims"
    SharedInflight.create(path, 2)
    holder = subprocess.Popen([sys.executable, "-c", HOLD_AND_STOP, str(path)])
    try:
        # it stopped itself inside the lock: the process's state says when, no guessing
        wait_for(
            lambda: psutil.Process(holder.pid).status() == psutil.STATUS_STOPPED,
            "the holder stopped while it holds the lock",
            60,
        )
        other = SharedInflight(path, 0)
        with pytest.raises(BlockingIOError):  # what every other worker's loop waited for
            fcntl.flock(other._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        stop = threading.Event()
        watcher = threading.Thread(
            target=processes.watch_lock, args=(path, lambda: {holder.pid}, stop)
        )
        started = time.monotonic()
        watcher.start()
        counted = threading.Thread(target=other.add, args=("http://a", 1, 16))
        counted.start()  # waits for the lock, as a worker's loop would
        # a guard against a hang, not a measurement: the watch kills after LOCK_STALL_S
        # and LOCK_CHECK_S (1.25 s); a loaded CI machine has taken up to seconds more
        counted.join(60)
        assert not counted.is_alive(), "the lock was never freed"
        assert holder.wait(60) == -signal.SIGKILL  # killed by the watch, not stopped
        # it waited at least the stall: the watch kills no holder sooner
        assert time.monotonic() - started >= processes.LOCK_STALL_S
        assert other.claimed("http://a") == (1, 16)
        stop.set()
        watcher.join()
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()


def test_the_lock_watch_kills_no_holder_that_goes_on_and_none_that_is_not_a_worker(
    tmp_path,
) -> None:
    """A lock taken and given back between two looks, or held by another process than a
    worker (the parent), is no stall."""
    path = tmp_path / "claims"
    SharedInflight.create(path, 2)
    watch, shared = LockWatch(path), SharedInflight(path, 0)
    assert watch.stalled(0.0, 1.0) is None  # free
    with shared.exclusive():
        assert watch.stalled(0.0, 1.0) is None  # first seen held
        assert watch.stalled(0.5, 1.0) is None  # not for a second yet
        assert watch.stalled(1.0, 1.0) == os.getpid()  # held since the look at 0
    with shared.exclusive():  # another acquisition by the same process: seen anew
        assert watch.stalled(2.0, 1.0) is None
    with shared.exclusive():
        assert watch.stalled(3.5, 1.0) is None
    assert watch.stalled(4.0, 1.0) is None  # free again
    watch.close()
    shared.close()


def test_limits_with_several_workers_need_redis(tmp_path) -> None:
    with pytest.raises(ValueError, match="redis_url"):
        GatewaySettings(home=tmp_path, workers=2, key_requests_per_min=10)
    assert GatewaySettings(home=tmp_path, workers=2).workers == 2  # no limits: no Redis


# --- two worker processes -------------------------------------------------------------
class Workers:
    """The gateway's parent process, its port, and connections to a chosen worker."""

    def __init__(self, proc: subprocess.Popen[bytes], port: int) -> None:
        self.parent = psutil.Process(proc.pid)
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.redis_url = ""  # the Redis the workers keep the key limits in
        self._spare: list[http.client.HTTPConnection] = []

    def pids(self) -> list[int]:
        """The workers (the spawned children; not multiprocessing's resource tracker)."""
        pids = []
        for kid in self.parent.children():
            # a killed worker is a zombie until the parent reaps it: not a worker any more
            with contextlib.suppress(psutil.NoSuchProcess):  # ZombieProcess included
                if kid.status() != psutil.STATUS_ZOMBIE and "spawn_main" in " ".join(kid.cmdline()):
                    pids.append(kid.pid)
        return sorted(pids)

    def _holder(self, local: tuple[str, int]) -> int | None:
        for pid in self.pids():
            with contextlib.suppress(psutil.NoSuchProcess):
                for c in psutil.Process(pid).net_connections(kind="tcp"):
                    if c.raddr and (c.raddr.ip, c.raddr.port) == local[:2]:
                        return pid
        return None

    def connect(self, pid: int) -> http.client.HTTPConnection:
        """A kept-alive connection that worker `pid` accepted (a worker that replaces a
        dead one takes connections once ready: until then the others take them)."""
        # a guard, not a measurement: a replacement is ready once its tokenizer loaded,
        # 20 s measured on two loaded cores
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
            conn.connect()
            assert conn.sock is not None
            local = conn.sock.getsockname()
            holder: list[int | None] = [None]

            def accepted(local: tuple[str, int] = local, holder: list[int | None] = holder) -> bool:
                holder[0] = self._holder(local)
                return holder[0] is not None

            # a guard, not a measurement: a worker just started takes its first connection
            # once its imports and start are done, 11 s measured on two loaded cores
            wait_for(accepted, "a worker accepted the connection", 120)
            if holder[0] == pid:
                return conn
            self._spare.append(conn)  # kept open, so the next connect may land elsewhere
            if len(self._spare) > 100:
                self._spare.pop(0).close()
            time.sleep(0.05)
        raise AssertionError(f"no connection reached worker {pid}")

    def close(self) -> None:
        for conn in self._spare:
            conn.close()


def _post(conn: http.client.HTTPConnection, key: str, **extra: Any) -> http.client.HTTPResponse:
    body = json.dumps({**CHAT, "max_tokens": MAX_TOKENS, **extra})
    headers = {"content-type": "application/json", "authorization": f"Bearer {key}"}
    conn.request("POST", "/v1/chat/completions", body, headers)
    return conn.getresponse()


def _held_stream(conn: http.client.HTTPConnection, key: str = FREE_KEY) -> http.client.HTTPResponse:
    """A stream that is answering (its first event read) and holds its KV claim."""
    r = _post(conn, key, stream=True)
    assert r.status == 200, r.read()
    assert b"data: " in r.read1(65536)
    return r


def _refused(conn: http.client.HTTPConnection, key: str, code: str) -> None:
    r = _post(conn, key, stream=True)
    body = json.loads(r.read())
    assert r.status == 429 and body["error"]["code"] == code, body


def _claimed(gw: Workers, backend: str) -> float:
    return metric(gw.url, "lorastack_gateway_backend_kv_claimed_tokens", backend=backend)


@pytest.fixture(scope="module")
def two_workers(embedded_model: Path, tmp_path_factory) -> Iterator[tuple[Workers, FakeState, str]]:
    require_redis_server()
    tmp = tmp_path_factory.mktemp("workers")
    keys = tmp / "keys.yaml"
    save_keys(
        keys,
        KeysFile(
            keys=[
                KeyEntry(name="free", sha256=hash_secret(FREE_KEY)),
                KeyEntry(name="limited", sha256=hash_secret(LIMITED_KEY), requests_per_min=2),
                KeyEntry(name="budget", sha256=hash_secret(BUDGET_KEY), budget_tokens=10**6),
            ]
        ),
    )
    state = FakeState(num_gpu_blocks=BLOCKS, block_size=B)
    state.tokens = [f" t{i}" for i in range(8)]
    state.pace_s = 30.0  # a stream lasts minutes: only the test ends one
    with serve_fake(state) as backend, serve_redis() as redis_url:
        port = free_port()
        env = dict(
            os.environ,
            HF_HUB_OFFLINE="1",
            LORASTACK_HOME=str(tmp / "home"),
            LORASTACK_TOKENIZERS=json.dumps({"smollm2": str(embedded_model)}),
            LORASTACK_KEYS_FILE=str(keys),
            LORASTACK_METRICS_KEY=METRICS_KEY,
            LORASTACK_REDIS_URL=redis_url,
            LORASTACK_KV_ADMIT_WAIT_S="0",
            LORASTACK_SCRAPE_INTERVAL_S="0.2",
        )
        cmd = [sys.executable, "-m", "lorastack.cli", "gateway", "--workers", "2"]
        cmd += ["--port", str(port), "--backend", backend]
        proc = subprocess.Popen(cmd, env=env)
        gw = Workers(proc, port)
        gw.redis_url = redis_url
        try:
            # a guard, not a measurement: the parent's start (imports) on loaded cores
            wait_for(lambda: len(gw.pids()) == 2, "two workers", 120)
            for pid in gw.pids():  # each worker answers ready (it has scraped the fake)
                conn = gw.connect(pid)
                wait_for(lambda c=conn: _ready(c), f"worker {pid} ready", 120)
                conn.close()
            yield gw, state, backend
        finally:
            gw.close()
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _ready(conn: http.client.HTTPConnection) -> bool:
    conn.request("GET", "/ready")
    r = conn.getresponse()
    r.read()
    return r.status == 200


def test_claims_limits_and_metrics_add_up_across_workers(two_workers) -> None:
    gw, state, backend = two_workers
    a, b = gw.pids()
    on_a = [gw.connect(a) for _ in range(3)]
    on_b = [gw.connect(b) for _ in range(3)]
    before = metric(gw.url, "lorastack_gateway_request_duration_seconds_count")
    # KV claims: room for two streams in all; one admitted by each worker fills it
    first = _held_stream(on_a[0])
    one_claim = _claimed(gw, backend)
    assert MAX_TOKENS < one_claim <= MAX_TOKENS + BOUND and one_claim % B == 0
    second = _held_stream(on_b[0])
    assert _claimed(gw, backend) == 2 * one_claim
    _refused(on_a[1], FREE_KEY, "overloaded")  # worker a sees b's claim, and b a's
    _refused(on_b[1], FREE_KEY, "overloaded")
    assert len(state.calls()) == 2 and state.preemptions == 0
    first.close()
    on_a[0].close()  # its client hung up: worker a gives the claim back
    wait_for(lambda: _claimed(gw, backend) == one_claim, "the claim given back")
    third = _held_stream(on_b[1])  # worker b admits into the room a gave back
    third.close()
    second.close()
    on_b[0].close()
    on_b[1].close()
    wait_for(lambda: _claimed(gw, backend) == 0, "every claim given back")

    # key limits (Redis): 2 requests a minute for `limited`, whichever worker takes them
    state.pace_s = 0.0
    for conn in (on_a[2], on_b[2]):
        r = _post(conn, LIMITED_KEY)
        assert r.status == 200, r.read()
        r.read()
    _refused(on_a[2], LIMITED_KEY, "rate_limit_exceeded")
    _refused(on_b[2], LIMITED_KEY, "rate_limit_exceeded")

    # /metrics, from either worker, counts both workers' requests
    answered = metric(gw.url, "lorastack_gateway_request_duration_seconds_count") - before
    assert answered == 5  # 3 streams (the client left: 499) + 2 answers (200)
    rejected = metric(gw.url, "lorastack_gateway_rejections_total", reason="overloaded")
    assert rejected == 2
    assert metric(gw.url, "lorastack_gateway_inflight_requests") == 0
    state.pace_s = 30.0
    for conn in (on_a[2], on_b[2]):
        conn.close()


def test_a_killed_worker_loses_only_its_streams_and_is_replaced(two_workers) -> None:
    gw, state, backend = two_workers
    a, b = gw.pids()
    conn_a, conn_b = gw.connect(a), gw.connect(b)
    lost, kept = _held_stream(conn_a), _held_stream(conn_b)
    one_claim = _claimed(gw, backend) / 2
    cancelled = state.cancelled
    os.kill(a, signal.SIGKILL)
    with contextlib.suppress(ConnectionError, http.client.IncompleteRead):
        assert lost.read() == b""  # its stream ends before its last event
    wait_for(lambda: state.cancelled == cancelled + 1, "the dead worker's stream aborted")
    wait_for(lambda: len(gw.pids()) == 2 and a not in gw.pids(), "a new worker", 60)
    wait_for(lambda: _claimed(gw, backend) == one_claim, "the dead worker's claims dropped")
    assert state.cancelled == cancelled + 1  # the other worker's stream goes on
    assert kept.fp is not None and not kept.isclosed()
    new = next(pid for pid in gw.pids() if pid != b)
    conn_new = gw.connect(new)
    wait_for(lambda: _ready(conn_new), "the new worker ready", 120)
    second = _held_stream(conn_new)  # the new worker admits beside b's stream
    assert _claimed(gw, backend) == 2 * one_claim
    for r, conn in ((kept, conn_b), (second, conn_new)):
        r.close()
        conn.close()
    wait_for(lambda: _claimed(gw, backend) == 0, "every claim given back")
    conn_a.close()


def test_a_killed_workers_reservation_stays_charged_in_full_and_expires(two_workers) -> None:
    """Issue 58, "a killed worker never refunds its Redis reservation": what happens. A
    request's tokens (prompt bound + max_tokens) are charged in Redis at admission and
    its unused part refunded at its end; a worker killed mid-stream never refunds it, and
    no other process can (only that worker knew how much was used). So the key stays
    charged the whole reservation: more than it used, never less, as a refund dropped
    while Redis is down. Nothing is held open: the tokens bucket refills on its own, and
    every key the script writes expires (buckets after 2 minutes untouched, a budget an
    hour past its period)."""
    import redis

    gw, _, _ = two_workers
    store = redis.Redis.from_url(gw.redis_url)
    a, _ = gw.pids()
    conn = gw.connect(a)
    stream = _held_stream(conn, BUDGET_KEY)
    (budget,) = store.keys("lorastack:limits:{budget}:budget:*")
    reserved = int(store.get(budget) or 0)
    assert MAX_TOKENS < reserved <= MAX_TOKENS + BOUND  # charged at admission, in full
    os.kill(a, signal.SIGKILL)
    wait_for(lambda: a not in gw.pids(), "the worker dead")  # its refund can never come
    with contextlib.suppress(ConnectionError, http.client.IncompleteRead):
        stream.read()
    conn.close()
    assert int(store.get(budget) or 0) == reserved  # not refunded, not charged twice
    assert store.ttl(budget) > 3600  # seconds: it expires an hour past the day's end
    wait_for(lambda: len(gw.pids()) == 2, "a new worker", 60)


def _scrapes(state: FakeState) -> int:
    return sum(path == "/metrics" for path, _ in state.authorizations)


def test_a_replacement_worker_accepts_no_connection_before_it_is_ready(two_workers) -> None:
    """Issue 58: a worker started in place of a dead one took connections from the shared
    socket before its first scrape and tokenizer load (its /ready said 503, its requests
    waited for the load) while the other worker could serve them. It accepts once its own
    /ready answers 200."""
    gw, state, _ = two_workers
    a, b = gw.pids()
    state.metrics_down = True  # the backend's scrapes fail: no worker starting is ready
    os.kill(a, signal.SIGKILL)
    wait_for(lambda: len(gw.pids()) == 2 and a not in gw.pids(), "a new worker", 60)
    new = next(pid for pid in gw.pids() if pid != b)
    os.kill(b, signal.SIGSTOP)  # now only the new worker could take a connection
    try:
        conn = http.client.HTTPConnection("127.0.0.1", gw.port, timeout=120)
        conn.request("GET", "/ready")  # queued on the shared socket
        assert conn.sock is not None
        local = conn.sock.getsockname()
        # b is stopped, so every scrape from now on is the new worker's: three more mean
        # its loop has turned many times since the connection was queued, any of which
        # would have accepted and answered it had it been listening
        seen = _scrapes(state)
        wait_for(lambda: _scrapes(state) >= seen + 3, "the new worker scraped again", 120)
        answered, _, _ = select.select([conn.sock], [], [], 0)
        assert not answered, "a worker that was not ready took the connection"
        assert gw._holder(local) is None
        state.metrics_down = False  # the next scrape finds the backend: ready
        r = conn.getresponse()
        assert r.status == 200 and json.loads(r.read()) == {"ready": True}
        assert gw._holder(local) == new
        conn.close()
    finally:
        os.kill(b, signal.SIGCONT)
        state.metrics_down = False


# --- two workers following DNS ---------------------------------------------------------
DNS_NAME = "inference.lorastack.svc.cluster.local"


def _get(conn: http.client.HTTPConnection, path: str, key: str) -> Any:
    conn.request("GET", path, headers={"authorization": f"Bearer {key}"})
    r = conn.getresponse()
    body = r.read()
    return json.loads(body) if path == "/ready" else body.decode()


def _sample(text: str, name: str) -> float:
    return sum(
        s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == name
    )


def test_with_workers_discovery_counts_each_event_once_and_a_gone_backend_leaves_no_series(
    embedded_model: Path, tmp_path: Path
) -> None:
    """Issue 58, finding 3: each worker follows the DNS, and prometheus_client's
    multiprocess files keep a series `Gauge.remove` cannot drop. Two replicas are found
    and one leaves: whichever worker answers /metrics counts 2 found and 1 removed (before:
    once per worker), and the one that left has no series any more (before: its gauges
    stayed, frozen)."""
    port = free_port()
    with contextlib.ExitStack() as stack:
        dns = stack.enter_context(DnsServer())
        replicas = [f"127.0.0.{n}" for n in (2, 3)]
        for ip in replicas:
            stack.enter_context(serve_fake(FakeState(), port, host=ip))
        dns.records[DNS_NAME] = replicas
        gw_port = free_port()
        env = dict(
            os.environ,
            HF_HUB_OFFLINE="1",
            LORASTACK_HOME=str(tmp_path / "home"),
            LORASTACK_TOKENIZERS=json.dumps({"smollm2": str(embedded_model)}),
            LORASTACK_METRICS_KEY=METRICS_KEY,
            LORASTACK_ADMIN_KEY=ADMIN_KEY,
            LORASTACK_BACKENDS_DNS=f"{DNS_NAME}:{port}",
            LORASTACK_BACKENDS_DNS_NAMESERVER=dns.address,
            LORASTACK_BACKENDS_DNS_INTERVAL_S="0.1",
            LORASTACK_SCRAPE_INTERVAL_S="0.2",
        )
        cmd = [sys.executable, "-m", "lorastack.cli", "gateway", "--workers", "2"]
        proc = subprocess.Popen([*cmd, "--port", str(gw_port)], env=env)
        gw = Workers(proc, gw_port)
        stack.callback(_stop_parent, proc)
        stack.callback(gw.close)
        wait_for(lambda: len(gw.pids()) == 2, "two workers", 60)
        conns = [gw.connect(pid) for pid in gw.pids()]
        left = f"http://127.0.0.3:{port}"
        for conn in conns:  # each worker has found and scraped both
            wait_for(lambda c=conn: len(_get(c, "/ready", ADMIN_KEY).get("backends", {})) == 2,
                     "both replicas found", 120)  # fmt: skip
        dns.records[DNS_NAME] = replicas[:1]
        for conn in conns:  # each worker has drained and forgotten the one that left
            wait_for(lambda c=conn: left not in _get(c, "/ready", ADMIN_KEY)["backends"],
                     "the replica forgotten", 60)  # fmt: skip
        for conn in conns:
            text = _get(conn, "/metrics", METRICS_KEY)
            assert _sample(text, "lorastack_gateway_backends_discovered_total") == 2
            assert _sample(text, "lorastack_gateway_backends_removed_total") == 1
            assert _sample(text, "lorastack_gateway_backends_draining") == 0
            assert left not in text  # no frozen gauge, no counter of a backend gone
            assert f"http://127.0.0.2:{port}" in text
            conn.close()


def _stop_parent(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def test_sigterm_with_workers_refuses_new_connections_at_once_while_streams_finish(
    embedded_model: Path, tmp_path: Path
) -> None:
    """Issue 58, finding 5: at SIGTERM the workers stop accepting, but the parent kept the
    listening socket open, so the kernel went on taking connections nobody would answer
    for as long as the workers drained. Now a connect is refused while a held stream still
    finishes (one worker behaves so too)."""
    state = FakeState(hold=threading.Event())  # a stream holds until the test sets it
    state.tokens = [f" t{i}" for i in range(4)]
    with contextlib.ExitStack() as stack:
        backend = stack.enter_context(serve_fake(state))
        stack.callback(state.hold.set)  # whatever happens, the fake's streams can end
        port = free_port()
        env = dict(
            os.environ,
            HF_HUB_OFFLINE="1",
            LORASTACK_HOME=str(tmp_path / "home"),
            LORASTACK_TOKENIZERS=json.dumps({"smollm2": str(embedded_model)}),
            LORASTACK_SHUTDOWN_GRACE_S="120",  # the held stream keeps the workers draining
        )
        cmd = [sys.executable, "-m", "lorastack.cli", "gateway", "--workers", "2"]
        proc = subprocess.Popen([*cmd, "--port", str(port), "--backend", backend], env=env)
        gw = Workers(proc, port)
        stack.callback(_stop_parent, proc)
        stack.callback(gw.close)
        wait_for(lambda: len(gw.pids()) == 2, "two workers", 60)
        conn = gw.connect(gw.pids()[0])
        wait_for(lambda: _ready(conn), "the worker ready", 120)
        stream = _post(conn, FREE_KEY, stream=True)
        assert stream.status == 200 and b"data: " in stream.read1(65536)
        proc.send_signal(signal.SIGTERM)

        def refused() -> bool:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=5).close()
            except ConnectionRefusedError:
                return True
            return False

        # 20 s: the time the parent and workers take to handle the signal on a loaded
        # machine; the stream below keeps the workers draining for 120 s
        wait_for(refused, "a new connection refused", 20)
        assert proc.poll() is None and not stream.isclosed()  # still draining
        assert state.hold is not None
        state.hold.set()
        assert stream.read().rstrip().endswith(b"data: [DONE]")  # the stream finishes whole
        assert proc.wait(60) == 0


def test_the_run_folder_of_a_parent_killed_by_sigkill_is_removed_at_the_next_start(
    embedded_model: Path, tmp_path: Path
) -> None:
    """Issue 58, finding 7: SIGKILL leaves the parent no `finally`, so its run folder (the
    shared counts, the metric files) stayed in the temporary directory; the next gateway
    removes the folders of parents no longer alive, and its own at SIGTERM."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = dict(
        os.environ,
        TMPDIR=str(tmp),
        HF_HUB_OFFLINE="1",
        LORASTACK_HOME=str(tmp_path / "home"),
        LORASTACK_TOKENIZERS=json.dumps({"smollm2": str(embedded_model)}),
    )
    cmd = [sys.executable, "-m", "lorastack.cli", "gateway", "--workers", "2"]
    cmd += ["--backend", "http://127.0.0.1:9"]  # no backend needed: nothing is sent

    def start() -> tuple[subprocess.Popen[bytes], Workers]:
        port = free_port()
        proc = subprocess.Popen([*cmd, "--port", str(port)], env=env)
        gw = Workers(proc, port)
        wait_for(lambda: len(gw.pids()) == 2, "two workers", 60)
        return proc, gw

    killed, gw = start()
    workers = [psutil.Process(pid) for pid in gw.pids()]
    killed.kill()
    killed.wait()
    psutil.wait_procs(workers, timeout=60)  # they follow their parent (PR_SET_PDEATHSIG)
    left = list(tmp.glob("lorastack-gateway-*"))
    assert len(left) == 1  # what SIGKILL leaves
    second, _ = start()
    try:
        folders = list(tmp.glob("lorastack-gateway-*"))
        assert not left[0].exists() and len(folders) == 1
        assert folders[0].name.startswith(f"lorastack-gateway-{second.pid}-")  # its own
    finally:
        _stop_parent(second)
    assert list(tmp.glob("lorastack-gateway-*")) == []
