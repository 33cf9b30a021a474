"""Encoding many conversations at once, on every core the process may use.

`encode_all` gives, for each conversation in order, what `check_sample` gives for it
alone: the sample (lean: without its text and offsets, most of its memory) or None, and
its problems. Small inputs run in this process. Large ones are cut into contiguous chunks
encoded by forked worker processes: rendering through the chat template and masking are
Python, so one process encodes a few hundred chats a second, and a dataset of 100k chats
would otherwise cost minutes before the first step. A worker that dies (the OOM killer)
fails the call with BrokenProcessPool rather than hanging it. Workers inherit the
tokenizer and the conversations from the fork (nothing is pickled to them) and send back
the samples; the result does not depend on the number of workers. Under torchrun each
process takes its share of the cores.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from lorastack.chat_data import Conversation
from trainer.data.masking import MaskingError, targets_end_with
from trainer.data.samples import LossOn, Pretokenized, Sample, encode

Result = tuple[Sample | None, list[tuple[str, str]]]

PARALLEL_FROM = 1024  # conversations; below this a worker pool costs more than it saves
CHUNK = 256  # conversations per task: one Rust tokenizer call each

_job: tuple[Sequence[Conversation], Any, LossOn, list[str], int] | None = None


def check_sample(
    conv: Conversation, tokenizer: Any, loss_on: LossOn, specials: list[str], eot: int
) -> Result:
    """Encode one conversation: (the sample, or None when it cannot be trained on; its
    problems as (kind, message), kind one of "special_token", "template", "eos")."""
    bad = sorted({t for m in conv.messages for t in specials if t in m.flat_text})
    if bad:  # the template's own markers inside a content: encoding it would mislead
        return None, [
            ("special_token", f"content holds special token(s) {', '.join(map(repr, bad))}")
        ]
    try:
        s = encode(conv, tokenizer, loss_on)
    except MaskingError as e:
        return None, [("template", str(e))]
    if not targets_end_with(s.labels, eot):
        return None, [("eos", "a target does not end with the end-of-turn token")]
    return s, []


def default_workers() -> int:
    """The cores this process may use, shared with the other processes of its node."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


def _encode_range(bounds: tuple[int, int]) -> list[Result]:
    assert _job is not None
    convs, tokenizer, loss_on, specials, eot = _job
    chunk = list(convs[bounds[0] : bounds[1]])
    tok = Pretokenized(tokenizer, chunk)
    results = (check_sample(conv, tok, loss_on, specials, eot) for conv in chunk)
    return [(s if s is None else s.lean(), bad) for s, bad in results]


def encode_all(
    convs: Sequence[Conversation],
    tokenizer: Any,
    loss_on: LossOn,
    specials: list[str],
    eot: int,
    *,
    workers: int | None = None,
    parallel_from: int = PARALLEL_FROM,
    chunk: int = CHUNK,
) -> list[Result]:
    """(sample or None, problems) for each of `convs`, in order; in `workers` processes
    (default: this process's cores) when there are at least `parallel_from`."""
    global _job
    workers = default_workers() if workers is None else workers
    ranges = [(i, min(i + chunk, len(convs))) for i in range(0, len(convs), chunk)]
    _job = (convs, tokenizer, loss_on, specials, eot)
    try:
        if workers < 2 or len(convs) < max(parallel_from, 2):
            return [r for bounds in ranges for r in _encode_range(bounds)]
        # the Rust tokenizer's own threads must not be inherited across the fork
        before = os.environ.get("TOKENIZERS_PARALLELISM")
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        try:
            with ProcessPoolExecutor(
                min(workers, len(ranges)), mp_context=multiprocessing.get_context("fork")
            ) as pool:
                chunks = list(pool.map(_encode_range, ranges))
        finally:
            if before is None:
                os.environ.pop("TOKENIZERS_PARALLELISM", None)
            else:
                os.environ["TOKENIZERS_PARALLELISM"] = before
        return [r for chunk in chunks for r in chunk]
    finally:
        _job = None
