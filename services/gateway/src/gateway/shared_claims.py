"""The in-flight counts, KV claims and admission line of `lorastack gateway --workers N`,
shared by the worker processes of one host: a file mapped into each (mmap), changed
under a lock on that file.

`SharedInflight` has the interface of `routing.InflightCounter` (one process), so routing,
admission and the upstream use either. What makes it exact across processes:

- every change, and every claim with the check that it fits (`exclusive()`, held by
  `Upstream.open` from confirming the backend routing chose, `claimed`, to the claim being
  counted), holds an `flock` on the file, so no two workers admit against the same room;
  routing itself scores on totals read without the lock (held around the scoring, it
  kept the workers waiting on each other); the kernel drops the lock of a process that
  dies, so a killed worker never blocks the others;
- each worker counts its requests and claims in a slot of its own; the parent zeroes a
  dead worker's slot (`clear_slot`) before its replacement starts: the dead worker's
  streams died with it (their backend connections closed, so vLLM aborted them);
- the line for KV room is one line across workers: each request in it holds a ticket
  (from one counter), and only the lowest ticket among the workers' line heads looks
  for room. A head in another worker learns of room given back within `POLL_S`.

Layout, int64 words: the next ticket, a version (bumped by every change: readers reuse
their last totals while it stands), the number of backend entries used, a registry
generation (bumped when an entry is taken or freed: each worker then reads the URLs
again); then the requests ever sent to each backend (routing compares it with a
scrape's); then per worker slot its line head's ticket, its waiting count, and per
backend its open requests and their KV claims (tokens). After the words, the backend
URLs, `URL_BYTES` each. A backend the gateway forgets (it left `backends_dns` and
drained) frees its entry once no worker counts anything on it, so replicas that come and
go with new addresses never run the table out.

Owns: that file. Does not own: what the counts mean (`routing.py`), the processes
(`processes.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import mmap
import os
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from gateway.routing import InflightCounter

MAX_BACKENDS = 256
URL_BYTES = 512  # bytes of one backend URL (UTF-8), at most
NO_TICKET = 2**62  # a slot whose line is empty
POLL_S = 0.01  # seconds between two looks of a line head at the room other workers gave back
_HEADER = 4  # next ticket, version, backend entries used, registry generation
_GENERATION = 3
_SENT = _HEADER
_SLOTS = _SENT + MAX_BACKENDS
_SLOT_WORDS = 2 + 2 * MAX_BACKENDS  # head ticket, waiting, counts[], tokens[]


def _size(workers: int) -> int:
    return (_SLOTS + workers * _SLOT_WORDS) * 8 + MAX_BACKENDS * URL_BYTES


@dataclass(frozen=True)
class WorkerSlot:
    """What worker `slot` of `--workers N` shares with the others (`processes.py` makes them)."""

    slot: int  # 0..N-1: where this worker counts its own requests
    claims: Path  # the shared counts (`SharedInflight`)
    metrics_dir: Path  # prometheus_client's multiprocess files (`metrics.py`)


class Turn(asyncio.Event):
    """A request's place in the line: set when it may look for room again."""

    def __init__(self, ticket: int) -> None:
        super().__init__()
        self.ticket = ticket


class SharedInflight:
    """One worker's view of the shared counts (its `slot` is where it counts its own)."""

    def __init__(self, path: Path, slot: int) -> None:
        self.path = path
        self.slot = slot
        self._fd = os.open(path, os.O_RDWR)  # opened per process: flock is per open file
        self._map = mmap.mmap(self._fd, 0)
        self._words = memoryview(self._map).cast("B").cast("q")
        self.workers = (len(self._map) - MAX_BACKENDS * URL_BYTES) // 8 - _SLOTS
        self.workers //= _SLOT_WORDS
        if not 0 <= slot < self.workers:
            raise ValueError(f"slot {slot} outside the {self.workers} workers of {path}")
        self._base = _SLOTS + slot * _SLOT_WORDS
        self._depth = 0  # the lock is re-entered within a process (flock is not counted)
        self._index: dict[str, int] = {}
        self._generation = 0  # of the registry `_index` was read at
        self._line: deque[Turn] = deque()
        self._seen = -1  # the version of the cached totals
        self._totals: tuple[dict[str, int], dict[str, int], dict[str, int]] = ({}, {}, {})

    @staticmethod
    def create(path: Path, workers: int) -> None:
        """A fresh file for `workers` slots, every line empty (the parent, before any worker)."""
        with open(path, "wb") as f:
            f.truncate(_size(workers))
        shared = SharedInflight(path, 0)
        with shared.exclusive():
            for slot in range(workers):
                shared._words[_SLOTS + slot * _SLOT_WORDS] = NO_TICKET
        shared.close()

    def close(self) -> None:
        """Release the shared words, unmap the file and close it."""
        self._words.release()
        self._map.close()
        os.close(self._fd)

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold the lock of every worker: what is read and changed meanwhile is exact."""
        if self._depth == 0:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def clear_slot(self, slot: int) -> None:
        """Forget what a dead worker counted (the parent, before it starts its replacement)."""
        w = self._words
        base = _SLOTS + slot * _SLOT_WORDS
        with self.exclusive():
            w[base] = NO_TICKET
            for i in range(1, _SLOT_WORDS):
                w[base + i] = 0
            w[1] += 1

    # --- backends -----------------------------------------------------------------
    def _backend(self, url: str) -> int:
        """The index of `url`'s counters, registered on first use by any worker (in the
        first free entry)."""
        if self._words[_GENERATION] == self._generation and (i := self._index.get(url)) is not None:
            return i
        raw = url.encode()
        if len(raw) > URL_BYTES:
            raise ValueError(f"backend URL of {len(raw)} bytes: at most {URL_BYTES}")
        with self.exclusive():
            self._load_urls()
            i = self._index.get(url)
            if i is None:
                used = int(self._words[2])
                free = [j for j in range(used) if self._map[self._url_at(j)] == 0]
                i = free[0] if free else used
                if i >= MAX_BACKENDS:
                    raise ValueError(f"more than {MAX_BACKENDS} backends at once")
                at = self._url_at(i)
                self._map[at : at + URL_BYTES] = raw.ljust(URL_BYTES, b"\0")
                self._words[2] = max(used, i + 1)
                self._words[_GENERATION] += 1  # every worker reads the URLs again
                self._load_urls()
        return i

    def forget(self, url: str) -> None:
        """Free `url`'s entry once no worker counts a request or claim on it (the gateway
        forgot the backend); a worker still counting keeps it until its own forget."""
        w = self._words
        with self.exclusive():
            self._load_urls()
            i = self._index.get(url)
            if i is None:
                return
            slots = [_SLOTS + s * _SLOT_WORDS for s in range(self.workers)]
            if any(w[b + 2 + i] or w[b + 2 + MAX_BACKENDS + i] for b in slots):
                return
            at = self._url_at(i)
            self._map[at : at + URL_BYTES] = bytes(URL_BYTES)
            w[_SENT + i] = 0
            w[_GENERATION] += 1
            w[1] += 1
            self._load_urls()

    def _url_at(self, i: int) -> int:
        return (_SLOTS + self.workers * _SLOT_WORDS) * 8 + i * URL_BYTES

    def _load_urls(self) -> None:
        """`_index` as the registry has it now (called with the lock held)."""
        self._index = {}
        for i in range(int(self._words[2])):
            at = self._url_at(i)
            if name := self._map[at : at + URL_BYTES].rstrip(b"\0"):
                self._index[name.decode()] = i
        self._generation = int(self._words[_GENERATION])

    # --- InflightCounter's interface ---------------------------------------------
    def add(self, url: str, delta: int, tokens: int = 0) -> None:
        """`delta` requests (+1 sent, -1 ended) holding `tokens` (signed like `delta`)."""
        i = self._backend(url)
        w = self._words
        with self.exclusive():
            w[self._base + 2 + i] += delta
            if delta > 0:
                w[_SENT + i] += delta
            if tokens:
                w[self._base + 2 + MAX_BACKENDS + i] += tokens
            w[1] += 1
        if delta < 0 and self._line:
            self._line[0].set()  # room given back: this worker's head looks again

    def _sums(self) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
        """Open requests, requests ever sent and KV claims per backend, all workers: exact
        under the lock; without it (routing's scores) each word is read whole, a change in
        progress may show in part, and the version it bumps has the next call read again."""
        w = self._words
        version = int(w[1])
        if version == self._seen:
            return self._totals
        if self._depth == 0 and w[_GENERATION] == self._generation:
            self._seen, self._totals = version, self._read_sums()
            return self._totals
        with self.exclusive():
            if w[_GENERATION] != self._generation:
                self._load_urls()
            self._seen, self._totals = int(w[1]), self._read_sums()
        return self._totals

    def _read_sums(self) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
        w = self._words
        counts, sent, tokens = {}, {}, {}
        slots = [_SLOTS + s * _SLOT_WORDS for s in range(self.workers)]
        for url, i in self._index.items():
            counts[url] = sum(w[b + 2 + i] for b in slots)
            tokens[url] = sum(w[b + 2 + MAX_BACKENDS + i] for b in slots)
            sent[url] = int(w[_SENT + i])
        return counts, sent, tokens

    def claimed(self, url: str) -> tuple[int, int]:
        """(open requests, their KV claims in tokens) on `url`, every worker's: the one
        backend `Admission` confirms a pick on, read under the lock without summing the others."""
        w = self._words
        slots = [_SLOTS + s * _SLOT_WORDS for s in range(self.workers)]
        with self.exclusive():
            i = self._backend(url)
            count = sum(w[b + 2 + i] for b in slots)
            tokens = sum(w[b + 2 + MAX_BACKENDS + i] for b in slots)
        return int(count), int(tokens)

    @property
    def counts(self) -> dict[str, int]:
        return self._sums()[0]

    @property
    def sent(self) -> dict[str, int]:
        return self._sums()[1]

    @property
    def tokens(self) -> dict[str, int]:
        return self._sums()[2]

    @property
    def waiting(self) -> int:
        """Requests in the line now, in every worker."""
        w = self._words
        return sum(int(w[_SLOTS + s * _SLOT_WORDS + 1]) for s in range(self.workers))

    def join(self) -> Turn:
        """A place at the end of the line (of every worker); `leave` it once admitted,
        refused or cancelled."""
        w = self._words
        with self.exclusive():
            turn = Turn(int(w[0]))
            w[0] += 1
            if not self._line:
                w[self._base] = turn.ticket
            w[self._base + 1] += 1
        self._line.append(turn)
        return turn

    def is_head(self, turn: asyncio.Event) -> bool:
        """`turn` leads this worker's line, and no other worker's head came before it."""
        if not self._line or self._line[0] is not turn:
            return False
        w = self._words
        with self.exclusive():
            first = min(int(w[_SLOTS + s * _SLOT_WORDS]) for s in range(self.workers))
        return first == self._line[0].ticket

    async def next_turn(self, turn: asyncio.Event, timeout_s: float) -> None:
        """Return once this worker gave room back or the line moved here, or after
        `POLL_S` (room another worker gave back), or after `timeout_s`."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(turn.wait(), min(timeout_s, POLL_S))
        turn.clear()

    def leave(self, turn: asyncio.Event) -> None:
        """Out of the line; the next head looks for room (some may be left)."""
        assert isinstance(turn, Turn)
        was_head = bool(self._line) and self._line[0] is turn
        self._line.remove(turn)
        w = self._words
        with self.exclusive():
            w[self._base] = self._line[0].ticket if self._line else NO_TICKET
            w[self._base + 1] -= 1
        if was_head and self._line:
            self._line[0].set()


# what routing, admission and the upstream count with: one process's, or every worker's
Inflight = InflightCounter | SharedInflight
