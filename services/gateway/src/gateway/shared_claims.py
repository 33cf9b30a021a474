"""The in-flight counts, KV claims and admission lines of `lorastack gateway --workers N`,
shared by the worker processes of one host: a file mapped into each (mmap), changed
under a lock on that file.

`SharedInflight` is the `claims.Claims` of every worker (`claims.InflightCounter` is one
process's), so admission, the upstream and discovery use either. What makes it exact
across processes:

- every change, and every claim with the check that it fits (`exclusive()`, held by
  `Upstream.open` from confirming the backend routing chose, `claimed`, to the claim being
  counted), holds an `flock` on the file, so no two workers admit against the same room;
  routing itself scores on totals read without the lock (held around the scoring, it
  kept the workers waiting on each other); the kernel drops the lock of a process that
  dies, so a killed worker never blocks the others, and the parent kills one that holds
  it for a second or more (stopped or frozen there: `LockWatch`);
- each worker counts its requests and claims in a slot of its own; the parent zeroes a
  dead worker's slot (`clear_slot`) before its replacement starts: the dead worker's
  streams died with it (their backend connections closed, so vLLM aborted them);
- the lines for KV room are one line per backend across workers: each waiting request
  holds a ticket (from one counter), each worker publishes per backend the lowest ticket
  of its own requests waiting there, and a request looks for room only on backends where
  no lower ticket waits (`blocked`). Waiting costs no CPU: room given back, or a request
  leaving a line, marks that backend in the wake-up words of the worker whose request is
  now first in its line and rings it (one datagram on its socket, `wake_address`); that
  worker reads its words and sets its own waiters' events; nothing polls.

Discovery (`backends_dns`, which every worker follows on its own) keeps each backend's
membership here too, so what it counts (`Membership`) is counted once, by the first
worker to see each change, whichever worker answers /metrics.

Layout, int64 words: the header (`_Header`: the next ticket, a version bumped by every
change, the number of backend entries used, a registry generation bumped when an entry
is taken or freed, the discovery counters, the lock's acquisitions); then the requests
ever sent to each backend (routing compares it with a scrape's) and each backend's
membership; then per worker slot (`_Slot` offsets, from `_slot_base`) its waiting count,
and per backend its open requests, their KV claims (tokens), the lowest ticket of its
requests waiting there and its wake-up word. After the words, the backend URLs,
`URL_BYTES` each. A backend the gateway forgets (it left `backends_dns` and drained)
frees its entry once no worker counts anything on it or waits for it, so replicas that
come and go with new addresses never run the table out.

Owns: that file and the wake-up sockets. Does not own: what the counts mean
(`claims.py`, `routing.py`), the processes (`processes.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import mmap
import os
import socket
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from gateway.claims import DRAINING, GONE, MEMBER, NO_TICKET, Membership, Turn

MAX_BACKENDS = 256
URL_BYTES = 512  # bytes of one backend URL (UTF-8), at most


class _Header:
    """Offsets of the words at the start of the file."""

    NEXT_TICKET = 0  # the ticket the next request to join a line takes
    VERSION = 1  # bumped by every change: readers reuse their last totals while it stands
    USED = 2  # backend entries used (a freed one among them has an empty URL)
    GENERATION = 3  # bumped when an entry is taken or freed: workers read the URLs again
    DISCOVERED = 4  # `Membership`: backends that appeared (again)
    REMOVED = 5  # `Membership`: backends forgotten once drained
    DRAINED_REQUESTS = 6  # `Membership`: requests open on backends as they began draining
    LOCKS = 7  # the lock's acquisitions, ever: `LockWatch` tells a stuck hold by it
    WORDS = 8


_SENT = _Header.WORDS  # per backend: requests ever sent to it (routing compares a scrape's)
# per backend: GONE, MEMBER or DRAINING (`backends_dns`), or _FORGOTTEN by a worker
# while another still counted on it
_MEMBERS = _SENT + MAX_BACKENDS
_FORGOTTEN = 3
_SLOTS = _MEMBERS + MAX_BACKENDS  # then one `_Slot` per worker, then the URLs


class _Slot:
    """Offsets of a worker slot's words from its start."""

    WAITING = 0  # requests of this worker in line
    COUNTS = 1  # per backend: open requests
    TOKENS = COUNTS + MAX_BACKENDS  # per backend: their KV claims, tokens
    HEADS = TOKENS + MAX_BACKENDS  # per backend: lowest ticket waiting there, or NO_TICKET
    WAKE = HEADS + MAX_BACKENDS  # per backend: 1 = its first waiter here should look again
    WORDS = WAKE + MAX_BACKENDS


def _slot_base(slot: int) -> int:
    """The word at which worker `slot`'s words start; `_slot_base(workers)`: the URLs'."""
    return _SLOTS + slot * _Slot.WORDS


def _size(workers: int) -> int:
    return _slot_base(workers) * 8 + MAX_BACKENDS * URL_BYTES


class Totals(NamedTuple):
    """Every worker's counts per backend URL."""

    counts: dict[str, int]  # open requests
    sent: dict[str, int]  # requests ever sent
    tokens: dict[str, int]  # KV claims of the open requests, tokens


def wake_address(claims: Path, slot: int) -> bytes:
    """The datagram socket worker `slot` is woken on: in Linux's abstract namespace, named
    after the shared file's inode, so it is no file (none is left behind by a killed
    worker or parent) and no path length limit applies."""
    st = os.stat(claims)
    return f"\0lorastack-gateway-{st.st_dev}-{st.st_ino}-{slot}".encode()


@dataclass(frozen=True)
class WorkerSlot:
    """What worker `slot` of `--workers N` shares with the others (`processes.py` makes them)."""

    slot: int  # 0..N-1: where this worker counts its own requests
    claims: Path  # the shared counts (`SharedInflight`)
    metrics_dir: Path  # prometheus_client's multiprocess files (`metrics.py`)


def _lock_holder(dev: int, inode: int) -> int | None:
    """The pid holding an `flock` on the file (`dev`, `inode`), as the kernel lists it in
    /proc/locks ("1: FLOCK ADVISORY WRITE PID MAJ:MIN:INODE 0 EOF"; a waiter's line has
    "->" before FLOCK); None when none does."""
    where = f"{os.major(dev):02x}:{os.minor(dev):02x}:{inode}"
    with contextlib.suppress(OSError), open("/proc/locks") as locks:
        for line in locks:
            fields = line.split()
            if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == where:
                return int(fields[4])
    return None


class LockWatch:
    """Tells a process that has held the shared file's lock since one acquisition for
    `stall_s` or longer: stopped (SIGSTOP, a debugger) or frozen while it held it, it
    stops every worker, whose loops wait for the lock. The kernel drops the lock of a
    process that dies, so the parent kills that one (`processes.watch_lock`)."""

    def __init__(self, path: Path) -> None:
        self._fd = os.open(path, os.O_RDWR)  # its own open file: its own flock
        st = os.fstat(self._fd)
        self._file = (st.st_dev, st.st_ino)
        self._map = mmap.mmap(self._fd, _Header.WORDS * 8)  # the header is all it reads
        self._words = memoryview(self._map).cast("B").cast("q")
        self._held: tuple[int, int, float] | None = None  # holder, acquisition, first seen

    def stalled(self, now: float, stall_s: float) -> int | None:
        """The pid of the holder when the lock has been held by the same acquisition since
        a call at least `stall_s` seconds before `now` (monotonic seconds), every call in
        between included; None while the lock is free or changes hands."""
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pass
        else:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            self._held = None
            return None
        holder = _lock_holder(*self._file)
        acquisition = int(self._words[_Header.LOCKS])
        if holder is None or self._held is None or self._held[:2] != (holder, acquisition):
            self._held = None if holder is None else (holder, acquisition, now)
            return None
        return holder if now - self._held[2] >= stall_s else None

    def close(self) -> None:
        """Unmap the header and close the file."""
        self._words.release()
        self._map.close()
        os.close(self._fd)


class SharedInflight:
    """One worker's view of the shared counts (its `slot` is where it counts its own)."""

    def __init__(self, path: Path, slot: int) -> None:
        self.path = path
        self.slot = slot
        self._fd = os.open(path, os.O_RDWR)  # opened per process: flock is per open file
        self._map = mmap.mmap(self._fd, 0)
        self._words = memoryview(self._map).cast("B").cast("q")
        self.workers = ((len(self._map) - MAX_BACKENDS * URL_BYTES) // 8 - _SLOTS) // _Slot.WORDS
        if not 0 <= slot < self.workers:
            raise ValueError(f"slot {slot} outside the {self.workers} workers of {path}")
        self._base = _slot_base(slot)
        self._depth = 0  # the lock is re-entered within a process (flock is not counted)
        self._index: dict[str, int] = {}
        self._generation = 0  # of the registry `_index` was read at
        # backend -> this worker's requests waiting for room on it, first come first
        self._lines: dict[str, list[Turn]] = {}
        self._seen = -1  # the version of the cached totals
        self._totals = Totals({}, {}, {})
        self._addresses = [wake_address(path, s) for s in range(self.workers)]
        self._sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sender.setblocking(False)
        self._inbox: socket.socket | None = None  # bound once this worker has a waiter
        self._inbox_loop: asyncio.AbstractEventLoop | None = None

    @staticmethod
    def create(path: Path, workers: int) -> None:
        """A fresh file for `workers` slots, every line empty (the parent, before any worker)."""
        with open(path, "wb") as f:
            f.truncate(_size(workers))
        shared = SharedInflight(path, 0)
        with shared.exclusive():
            for slot in range(workers):
                heads = _slot_base(slot) + _Slot.HEADS
                for i in range(MAX_BACKENDS):
                    shared._words[heads + i] = NO_TICKET
        shared.close()

    def close(self) -> None:
        """Release the shared words, unmap the file and close it (and the wake socket)."""
        if self._inbox is not None:
            if self._inbox_loop is not None and not self._inbox_loop.is_closed():
                self._inbox_loop.remove_reader(self._inbox.fileno())
            self._inbox.close()
        self._sender.close()
        self._words.release()
        self._map.close()
        os.close(self._fd)

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold the lock of every worker: what is read and changed meanwhile is exact."""
        if self._depth == 0:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            self._words[_Header.LOCKS] += 1
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _bases(self) -> list[int]:
        return [_slot_base(s) for s in range(self.workers)]

    def clear_slot(self, slot: int) -> None:
        """Forget what a dead worker counted and what it had waiting (the parent, before it
        starts its replacement), and free the entries of backends the others forgot that
        only its counts kept; every other worker looks at its lines again, since the dead
        one's requests may have come first in them."""
        w = self._words
        base = _slot_base(slot)
        with self.exclusive():
            for i in range(_Slot.WORDS):
                w[base + i] = 0
            for i in range(MAX_BACKENDS):
                w[base + _Slot.HEADS + i] = NO_TICKET
            for other in range(self.workers):
                for i in range(MAX_BACKENDS):
                    w[_slot_base(other) + _Slot.WAKE + i] = int(other != slot)
            self._load_urls()
            for i in list(self._index.values()):  # forgotten, kept only by the dead worker
                if w[_MEMBERS + i] == _FORGOTTEN and self._unused(i):
                    self._free(i)
            w[_Header.VERSION] += 1
        for other in range(self.workers):
            if other != slot:
                self._ring(other)

    # --- backends -----------------------------------------------------------------
    def _backend(self, url: str) -> int:
        """The index of `url`'s counters, registered on first use by any worker (in the
        first free entry)."""
        if (
            self._words[_Header.GENERATION] == self._generation
            and (i := self._index.get(url)) is not None
        ):
            return i
        raw = url.encode()
        if len(raw) > URL_BYTES:
            raise ValueError(f"backend URL of {len(raw)} bytes: at most {URL_BYTES}")
        with self.exclusive():
            self._load_urls()
            i = self._index.get(url)
            if i is None:
                used = int(self._words[_Header.USED])
                free = [j for j in range(used) if self._map[self._url_at(j)] == 0]
                i = free[0] if free else used
                if i >= MAX_BACKENDS:
                    raise ValueError(f"more than {MAX_BACKENDS} backends at once")
                at = self._url_at(i)
                self._map[at : at + URL_BYTES] = raw.ljust(URL_BYTES, b"\0")
                self._words[_Header.USED] = max(used, i + 1)
                self._words[_Header.GENERATION] += 1  # every worker reads the URLs again
                self._load_urls()
        return i

    def forget(self, url: str) -> None:
        """The gateway forgot `url` (drained): removed, if it was draining (by the first
        worker to forget it); its entry is freed once no worker counts a request or claim
        on it, or has one waiting for it. One still counting keeps it until its own
        forget, or until its death (`clear_slot` frees what only it held)."""
        w = self._words
        with self.exclusive():
            self._load_urls()
            i = self._index.get(url)
            if i is None:
                return
            if w[_MEMBERS + i] == DRAINING:
                w[_Header.REMOVED] += 1
            w[_MEMBERS + i] = _FORGOTTEN
            if self._unused(i):
                self._free(i)

    def _unused(self, i: int) -> bool:
        """No worker counts a request or claim on entry `i`, nor has one waiting for it."""
        w = self._words
        return not any(
            w[b + _Slot.COUNTS + i]
            or w[b + _Slot.TOKENS + i]
            or w[b + _Slot.HEADS + i] != NO_TICKET
            for b in self._bases()
        )

    def _free(self, i: int) -> None:
        """Free entry `i` for another URL (with the lock held)."""
        w = self._words
        at = self._url_at(i)
        self._map[at : at + URL_BYTES] = bytes(URL_BYTES)
        w[_SENT + i] = 0
        w[_MEMBERS + i] = GONE
        w[_Header.GENERATION] += 1
        w[_Header.VERSION] += 1
        self._load_urls()

    def found(self, url: str) -> None:
        """`url` appeared in `backends_dns`: discovered, unless a worker found it already."""
        w = self._words
        with self.exclusive():
            i = self._backend(url)
            if w[_MEMBERS + i] in (GONE, _FORGOTTEN):
                w[_MEMBERS + i] = MEMBER
                w[_Header.DISCOVERED] += 1

    def draining(self, url: str, open_requests: int) -> None:
        """`url` left `backends_dns` with `open_requests` (every worker's) open on it:
        counted by the first worker to see it go."""
        w = self._words
        with self.exclusive():
            i = self._backend(url)
            if w[_MEMBERS + i] == MEMBER:
                w[_MEMBERS + i] = DRAINING
                w[_Header.DRAINED_REQUESTS] += open_requests

    def resumed(self, url: str) -> None:
        """`url` came back to `backends_dns` while draining."""
        w = self._words
        with self.exclusive():
            i = self._backend(url)
            if w[_MEMBERS + i] == DRAINING:
                w[_MEMBERS + i] = MEMBER

    def membership(self) -> Membership:
        """The discovery counters and the backends draining now, of every worker."""
        w = self._words
        with self.exclusive():
            used = int(w[_Header.USED])
            draining = sum(w[_MEMBERS + i] == DRAINING for i in range(used))
            return Membership(
                discovered=int(w[_Header.DISCOVERED]),
                removed=int(w[_Header.REMOVED]),
                drained_requests=int(w[_Header.DRAINED_REQUESTS]),
                draining=draining,
            )

    def _url_at(self, i: int) -> int:
        return _slot_base(self.workers) * 8 + i * URL_BYTES

    def _load_urls(self) -> None:
        """`_index` as the registry has it now (called with the lock held)."""
        self._index = {}
        for i in range(int(self._words[_Header.USED])):
            at = self._url_at(i)
            if name := self._map[at : at + URL_BYTES].rstrip(b"\0"):
                self._index[name.decode()] = i
        self._generation = int(self._words[_Header.GENERATION])

    # --- the rest of `claims.Claims` ---------------------------------------------
    def add(self, url: str, delta: int, tokens: int = 0) -> None:
        """`delta` requests (+1 sent, -1 ended) holding `tokens` (signed like `delta`);
        room given back wakes the worker first in `url`'s line."""
        i = self._backend(url)
        w = self._words
        with self.exclusive():
            w[self._base + _Slot.COUNTS + i] += delta
            if delta > 0:
                w[_SENT + i] += delta
            if tokens:
                w[self._base + _Slot.TOKENS + i] += tokens
            w[_Header.VERSION] += 1
            first = self._first_waiting(i) if delta < 0 else None
        if first is not None:
            self._wake(first, url)

    def _first_waiting(self, i: int) -> int | None:
        """The slot whose request is first in backend `i`'s line; None when none waits."""
        w = self._words
        tickets = [int(w[b + _Slot.HEADS + i]) for b in self._bases()]
        first = min(tickets)
        return None if first == NO_TICKET else tickets.index(first)

    def _wake(self, slot: int, url: str) -> None:
        """Have worker `slot`'s first request in `url`'s line look for room again."""
        if slot == self.slot:
            if line := self._lines.get(url):
                line[0].set()
            return
        with self.exclusive():
            self._words[_slot_base(slot) + _Slot.WAKE + self._backend(url)] = 1
        self._ring(slot)

    def _ring(self, slot: int) -> None:
        """One datagram to worker `slot`: read your wake-up words. A full socket holds
        unread datagrams already, each of which makes it read them all; a worker with no
        socket has no waiter."""
        with contextlib.suppress(OSError):
            self._sender.sendto(b"w", self._addresses[slot])

    def _woken(self) -> None:
        """Another worker gave room back, or left a line: the first request of each line
        it marked looks again."""
        assert self._inbox is not None
        with contextlib.suppress(OSError):
            while self._inbox.recv(64):
                pass
        w = self._words
        wake = self._base + _Slot.WAKE
        marked = []
        with self.exclusive():
            if w[_Header.GENERATION] != self._generation:
                self._load_urls()
            for url, i in self._index.items():
                if w[wake + i]:
                    w[wake + i] = 0
                    marked.append(url)
        for url in marked:
            if line := self._lines.get(url):
                line[0].set()

    def _listen(self) -> None:
        """Bind this worker's wake socket and read it on the running loop (once per loop)."""
        loop = asyncio.get_running_loop()
        if self._inbox is None:
            self._inbox = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._inbox.setblocking(False)
            self._inbox.bind(self._addresses[self.slot])
        if self._inbox_loop is not loop:
            if self._inbox_loop is not None and not self._inbox_loop.is_closed():
                self._inbox_loop.remove_reader(self._inbox.fileno())
            loop.add_reader(self._inbox.fileno(), self._woken)
            self._inbox_loop = loop

    def _sums(self) -> Totals:
        """Open requests, requests ever sent and KV claims per backend, all workers: exact
        under the lock; without it (routing's scores) each word is read whole, a change in
        progress may show in part, and the version it bumps has the next call read again."""
        w = self._words
        version = int(w[_Header.VERSION])
        if version == self._seen:
            return self._totals
        if self._depth == 0 and w[_Header.GENERATION] == self._generation:
            self._seen, self._totals = version, self._read_sums()
            return self._totals
        with self.exclusive():
            if w[_Header.GENERATION] != self._generation:
                self._load_urls()
            self._seen, self._totals = int(w[_Header.VERSION]), self._read_sums()
        return self._totals

    def _read_sums(self) -> Totals:
        w = self._words
        totals = Totals({}, {}, {})
        bases = self._bases()
        for url, i in self._index.items():
            totals.counts[url] = sum(w[b + _Slot.COUNTS + i] for b in bases)
            totals.tokens[url] = sum(w[b + _Slot.TOKENS + i] for b in bases)
            totals.sent[url] = int(w[_SENT + i])
        return totals

    def claimed(self, url: str) -> tuple[int, int]:
        """(open requests, their KV claims in tokens) on `url`, every worker's: the one
        backend `Admission` confirms a pick on, read under the lock without summing the others."""
        w = self._words
        bases = self._bases()
        with self.exclusive():
            i = self._backend(url)
            count = sum(w[b + _Slot.COUNTS + i] for b in bases)
            tokens = sum(w[b + _Slot.TOKENS + i] for b in bases)
        return int(count), int(tokens)

    @property
    def counts(self) -> dict[str, int]:
        return self._sums().counts

    @property
    def sent(self) -> dict[str, int]:
        return self._sums().sent

    @property
    def tokens(self) -> dict[str, int]:
        return self._sums().tokens

    @property
    def waiting(self) -> int:
        """Requests in line now, in every worker."""
        w = self._words
        return sum(int(w[b + _Slot.WAITING]) for b in self._bases())

    def blocked(self, turn: Turn | None) -> frozenset[str]:
        """Backends where a request that came before `turn` (None: any request) waits, in
        any worker: each word read whole (exact under the lock)."""
        if not self.waiting:
            return frozenset()
        if self._words[_Header.GENERATION] != self._generation:
            with self.exclusive():
                self._load_urls()
        w = self._words
        ticket = NO_TICKET if turn is None else turn.ticket
        bases = self._bases()
        return frozenset(
            url
            for url, i in self._index.items()
            if any(w[b + _Slot.HEADS + i] < ticket for b in bases)
        )

    def join(self, backends: Collection[str]) -> Turn:
        """A place at the end of the line of each of `backends` (of every worker); `leave`
        it once admitted, refused or cancelled."""
        self._listen()  # before it is seen waiting: no wake-up can be lost
        urls = frozenset(backends)
        index = {url: self._backend(url) for url in urls}
        w = self._words
        with self.exclusive():
            turn = Turn(int(w[_Header.NEXT_TICKET]), urls)
            w[_Header.NEXT_TICKET] += 1
            for url, i in index.items():
                line = self._lines.setdefault(url, [])
                if not line:
                    w[self._base + _Slot.HEADS + i] = turn.ticket
                line.append(turn)
            w[self._base + _Slot.WAITING] += 1
        return turn

    def heads(self, turn: Turn) -> bool:
        """Whether `turn` is first in this worker's line of one of its backends."""
        return any(self._lines[url][0] is turn for url in turn.backends)

    async def next_turn(self, turn: Turn, timeout_s: float, relook_s: float) -> None:
        """Return once woken (room given back on one of `turn`'s backends, or the request
        before it left, in any worker), after `relook_s` when `turn` is first in this
        worker's line of a backend (a scrape may have found room), or after `timeout_s`."""
        wait_s = min(timeout_s, relook_s) if self.heads(turn) else timeout_s
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(turn.wait(), wait_s)
        turn.clear()

    def leave(self, turn: Turn) -> None:
        """Out of the line; the next on each of its backends, in whichever worker, looks
        for room."""
        w = self._words
        woken: list[tuple[int, str]] = []
        with self.exclusive():
            for url in turn.backends:
                line = self._lines[url]
                was_head = line[0] is turn
                line.remove(turn)
                if not was_head:
                    continue
                i = self._backend(url)
                w[self._base + _Slot.HEADS + i] = line[0].ticket if line else NO_TICKET
                if not line:
                    del self._lines[url]
                first = self._first_waiting(i)
                if first is not None and turn.ticket < w[_slot_base(first) + _Slot.HEADS + i]:
                    woken.append((first, url))  # it was first of every worker's: the next is
            w[self._base + _Slot.WAITING] -= 1
        for slot, url in woken:
            self._wake(slot, url)
