"""Who sends a level's requests: its shares, sent in this process or spread over client
processes.

Owns: cutting a level into `Share`s (which request indices, with how many in flight or at
which arrival times), sending one share (`send_share`), and `ClientProcesses`, the spawned
processes that each send a share of every level when `--processes` is above 1, starting
together at the level's start. Each sender says how much CPU it used, so the report can
tell when the load generator itself was the limit.
Does not own: one request's timing (`loadtest_run.send_streaming`), the figures
(`loadtest_stats`).

Why processes: one Python client tops out near one core, and a client at a full core
measures itself rather than the server (a few streams of a fast GPU model are enough:
bench/serving/README.md). N processes have N cores for the same level.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import httpx

from evaluation.endpoint import error_text, make_client
from evaluation.loadtest_config import LoadtestConfig
from evaluation.loadtest_prompts import Tokenizer, load_tokenizer
from evaluation.loadtest_stats import Level, RequestRecord
from lorastack.sse import BadEvent, EventReader, chunk_text

# from handing the shares out to the level's start (each process waits idle for its job)
START_MARGIN_S = 0.25


@dataclass(frozen=True)
class Share:
    """The requests one sender sends of a level: `payloads[k]` is request `indices[k]`."""

    indices: list[int]
    payloads: list[dict[str, Any]]
    in_flight: int  # at most this many at once (concurrency levels; the cap at rate levels)
    arrivals: list[float] | None = None  # rate levels: seconds after the start, per request


@dataclass(frozen=True)
class ShareDone:
    """What sending one share gave: its records, when it ended, and the CPU it took."""

    records: list[RequestRecord]
    end: float  # perf_counter when the last request ended
    cpu_s: float  # CPU seconds the sender used for the share


def _split(total: int, parts: int) -> list[int]:
    """`total` as `parts` whole numbers that differ by one at most, larger first."""
    return [total // parts + (p < total % parts) for p in range(parts)]


def split_level(
    level: Level,
    payloads: list[dict[str, Any]],
    processes: int,
    *,
    arrivals: list[float] | None = None,
    max_concurrency: int | None = None,
) -> list[Share]:
    """The level's requests cut into at most `processes` shares, none empty.

    Concurrency c: the shares hold c // p or c // p + 1 of the streams each and requests in
    that proportion (contiguous indices). Rate: request i goes to share i mod p, at its own
    arrival time (the arrivals are the level's, whoever sends them); the cap on requests in
    flight, if any, is split like the streams."""
    n = len(payloads)
    if level.kind == "concurrency":
        streams = _split(int(level.value), min(processes, int(level.value), n))
        sizes = [n * s // int(level.value) for s in streams]
        for p in range(n - sum(sizes)):  # the remainder, one each to the first shares
            sizes[p % len(sizes)] += 1
        shares, at = [], 0
        for s, size in zip(streams, sizes, strict=True):
            if size:
                shares.append(Share(list(range(at, at + size)), payloads[at : at + size], s))
            at += size
        return shares
    assert arrivals is not None and len(arrivals) == n
    parts = min(processes, n, max_concurrency or n)
    caps = _split(max_concurrency, parts) if max_concurrency else [n] * parts
    return [
        Share(
            list(range(p, n, parts)),
            payloads[p::parts],
            caps[p],
            arrivals[p::parts],
        )
        for p in range(parts)
    ]


async def send_share(
    client: httpx.AsyncClient,
    url: str,
    share: Share,
    *,
    start: float,
    deadline: float,
    chat: bool,
    tokenizer: Tokenizer | None,
) -> ShareDone:
    """Send `share` from `start` (a perf_counter time shared by every sender of the level);
    no request starts after `deadline`."""
    cpu0 = time.process_time()
    await asyncio.sleep(max(0.0, start - time.perf_counter()))
    records: list[RequestRecord] = []

    async def one(k: int) -> None:
        records.append(
            await send_streaming(
                client, url, share.payloads[k], index=share.indices[k], level_start=start,
                chat=chat, tokenizer=tokenizer,
            )
        )  # fmt: skip

    if share.arrivals is None:
        queue = iter(range(len(share.indices)))

        async def worker() -> None:
            for k in queue:  # shared iterator: each request is taken once
                if time.perf_counter() > deadline:
                    return
                await one(k)

        await asyncio.gather(*(worker() for _ in range(share.in_flight)))
    else:
        await _send_at_arrivals(
            one, share.arrivals, in_flight=share.in_flight, start=start, deadline=deadline
        )
    return ShareDone(records, time.perf_counter(), time.process_time() - cpu0)


async def _send_at_arrivals(
    send: Callable[[int], Awaitable[None]],
    arrivals: list[float],
    *,
    in_flight: int,
    start: float,
    deadline: float,
) -> None:
    """`send(k)` at `start + arrivals[k]` (perf_counter seconds), at most `in_flight` at
    once; none after `deadline`."""
    gate = asyncio.Semaphore(in_flight)
    tasks = []

    async def gated(k: int) -> None:
        async with gate:
            await send(k)

    for k, at in enumerate(arrivals):
        if start + at > deadline:
            break
        delay = start + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(gated(k)))
    await asyncio.gather(*tasks)


async def send_streaming(
    client: httpx.AsyncClient,
    url: str,
    payload: dict[str, Any],
    *,
    index: int,
    level_start: float,
    chat: bool,
    tokenizer: Tokenizer | None,
) -> RequestRecord:
    """One streamed request; the time of each content chunk is taken as its bytes arrive."""
    sent = time.perf_counter()
    rec = RequestRecord(index=index, sent_s=sent - level_start)
    text_parts: list[str] = []
    usage_tokens: int | None = None
    try:
        # identity encoding: raw bytes are the SSE text, read without httpx's line decoder
        # (it added ~10 ms per first chunk at 4 streams on a busy 2-core machine)
        async with client.stream(
            "POST", url, json=payload, headers={"Accept-Encoding": "identity"}
        ) as response:
            if response.status_code != 200:
                await response.aread()
                rec.error = f"HTTP {response.status_code}: {error_text(response)}"[:300]
                return rec
            reader = EventReader()
            async for raw in response.aiter_raw():
                now = time.perf_counter()  # all events of one read arrived now
                try:
                    events = reader.feed(raw)
                except BadEvent as e:
                    rec.error = str(e)
                    return rec
                for data in events:
                    if "error" in data and not data.get("choices"):
                        err = data["error"]
                        rec.error = str(err.get("message") if isinstance(err, dict) else err)[:300]
                        return rec
                    if piece := chunk_text(data, chat=chat):
                        rec.chunk_times_s.append(now - sent)
                        text_parts.append(piece)
                    if usage := data.get("usage"):
                        usage_tokens = usage.get("completion_tokens")
                        rec.prompt_tokens = usage.get("prompt_tokens")
                # after [DONE], read on to the end of the body: the connection stays reusable
    except httpx.HTTPError as e:
        rec.error = f"{type(e).__name__}: {e}"[:300]
        return rec
    return _count_output(rec, usage_tokens, "".join(text_parts), tokenizer)


def _count_output(
    rec: RequestRecord, usage_tokens: int | None, text: str, tokenizer: Tokenizer | None
) -> RequestRecord:
    """`rec` with its times and output tokens from the chunks received: the server's usage,
    else the tokenizer's count of `text`, else one per chunk."""
    if not rec.chunk_times_s:
        rec.error = "the stream ended without any content"
        return rec
    rec.ttft_s = rec.chunk_times_s[0]
    rec.e2e_s = rec.chunk_times_s[-1]
    if usage_tokens:
        rec.output_tokens, rec.token_source = int(usage_tokens), "usage"
    elif tokenizer is not None:
        ids = tokenizer.encode(text, add_special_tokens=False)
        rec.output_tokens, rec.token_source = len(ids), "tokenizer"
    else:
        rec.output_tokens, rec.token_source = len(rec.chunk_times_s), "chunks"
    return rec


class ClientProcesses:
    """`n` spawned processes, each sending one share of every level it is given; use as a
    context manager (the processes end with it)."""

    def __init__(self, n: int, config: LoadtestConfig, url: str) -> None:
        ctx = multiprocessing.get_context("spawn")  # no fork of a process holding a loop
        self._conns: list[Connection] = []
        self._procs: list[Any] = []
        for _ in range(n):
            here, there = ctx.Pipe()
            proc = ctx.Process(target=_client_main, args=(there, config, url), daemon=True)
            proc.start()
            there.close()
            self._conns.append(here)
            self._procs.append(proc)
        for conn, proc in zip(self._conns, self._procs, strict=True):
            self._receive(conn, proc)  # "ready": imported, tokenizer loaded

    @property
    def size(self) -> int:
        return len(self._procs)

    def __enter__(self) -> ClientProcesses:
        return self

    def __exit__(self, *exc: object) -> None:
        for conn in self._conns:
            try:
                conn.send(None)
            except OSError:
                pass
        for proc in self._procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join()

    def run(self, shares: list[Share], deadline_s: float) -> tuple[float, list[ShareDone]]:
        """Send the shares (one a process) from a common start; (start, what each sent)."""
        assert len(shares) <= len(self._conns)
        start = time.perf_counter() + START_MARGIN_S
        deadline = start + deadline_s
        for conn, share in zip(self._conns, shares, strict=False):
            conn.send((share, start, deadline))
        return start, [
            self._receive(conn, proc)
            for conn, proc, _ in zip(self._conns, self._procs, shares, strict=False)
        ]

    @staticmethod
    def _receive(conn: Connection, proc: Any) -> Any:
        try:
            kind, value = conn.recv()
        except EOFError:
            proc.join(5)
            raise RuntimeError(
                f"a load-test client process ended (exit code {proc.exitcode}) before answering"
            ) from None
        if kind == "error":
            raise RuntimeError(f"a load-test client process failed:\n{value}")
        return value


def _client_main(conn: Connection, config: LoadtestConfig, url: str) -> None:
    """A client process: answer ("ready", None), then one ShareDone per share received,
    until None arrives; an exception goes back as ("error", its traceback)."""
    try:
        tokenizer = load_tokenizer(config.tokenizer) if config.tokenizer else None
        conn.send(("ready", None))
        while (job := conn.recv()) is not None:
            share, start, deadline = job
            conn.send(("done", asyncio.run(_send(config, url, share, start, deadline, tokenizer))))
    except EOFError:
        return
    except BaseException:
        conn.send(("error", traceback.format_exc()))


async def _send(
    config: LoadtestConfig,
    url: str,
    share: Share,
    start: float,
    deadline: float,
    tokenizer: Tokenizer | None,
) -> ShareDone:
    key = config.api_key.get_secret_value() if config.api_key else None
    async with make_client(key, config.timeout_s, max_connections=share.in_flight + 2) as client:
        return await send_share(
            client, url, share, start=start, deadline=deadline,
            chat=config.endpoint == "chat", tokenizer=tokenizer,
        )  # fmt: skip
