"""Replays a parity reference (lorastack.parity) through vLLM and judges what comes back.

Owns the HTTP side of the check: for each probe, vLLM's `/tokenize` renders the probe's
messages with the chat template the server uses and encodes the recorded prompt text
with the server's tokenizer; `/v1/completions` decodes greedily from the trained prompt's
token ids and teacher-forces the recorded answer (`replay_probe`). Probes go to vLLM at
once, so it batches them; every request's timeout is cut to what is left of the check's
deadline. vLLM's errors become EngineFailed. The verdict itself is lorastack.parity.judge;
`ParityChecks` is the supervisor's use of it, and it fails closed: a check that cannot run
refuses the model under `refuse` (and `auto` where the reference is readable and unquantised).
Owns the record kept per served name (`ParityRecord`: a verdict, a check that could not run,
or no reference), which /status shows field by field and /metrics reads, and `Checked`, what
one check decided.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field

from inference import vllm_api
from inference.errors import EngineFailed
from lorastack.parity import (
    REFERENCE_FILE,
    Limits,
    Parting,
    Policy,
    ProbeRecord,
    Reference,
    Replay,
    UnreadableReference,
    Verdict,
    default_policy,
    judge,
    read_reference_bytes,
)

log = logging.getLogger(__name__)


def read_reference(folder: Path) -> Reference | None:
    """The reference an artifact folder carries; None when it has none (made before
    references were recorded, or with parity_probes: 0). A damaged one is
    UnreadableReference, naming what is wrong."""
    path = folder / REFERENCE_FILE
    if not path.is_file():
        return None
    return read_reference_bytes(path.read_bytes(), str(path))


class _Vllm:
    """vLLM's API as the replay asks it: one served model, its key, a per-request timeout
    and the deadline of the whole check (time.monotonic())."""

    def __init__(
        self, base_url: str, model: str, api_key: str | None, timeout_s: float, deadline: float
    ) -> None:
        self.base_url, self.model, self.api_key = base_url, model, api_key
        self.timeout_s, self.deadline = timeout_s, deadline

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise EngineFailed(
                "the parity replay ran out of time (parity_timeout_s)",
                "see vLLM's log: is it overloaded or hanging? (or raise parity_timeout_s)",
            )
        return vllm_api.post_json(
            self.base_url,
            path,
            {"model": self.model, **body},
            api_key=self.api_key,
            timeout_s=min(self.timeout_s, left),
        )

    def tokens(self, body: dict[str, Any]) -> list[int]:
        answer = self.post("/tokenize", {"add_special_tokens": False, **body})
        return [int(t) for t in answer["tokens"]]

    def text(self, tokens: list[int]) -> str:
        return str(self.post("/detokenize", {"tokens": tokens})["prompt"])


TOP_LOGPROBS = 20  # alternatives vLLM returns per position (its default max_logprobs)


def _steps(answer: dict[str, Any]) -> list[tuple[list[int], list[dict[int, float]]]]:
    """Per choice: the generated token ids and, per position, the most likely tokens' ids
    and log-probabilities (`return_tokens_as_token_ids` writes tokens as "token_id:N")."""

    def token_id(text: str) -> int:
        return int(str(text).rpartition(":")[2])

    out = []
    for choice in sorted(answer["choices"], key=lambda c: int(c["index"])):
        lp = choice["logprobs"]
        tops = [
            {token_id(t): float(v) for t, v in (top or {}).items()} for top in lp["top_logprobs"]
        ]
        out.append(([token_id(t) for t in lp["tokens"]], tops))
    return out


@dataclass(frozen=True)
class Forced:
    """The server at one reference position, the reference token forced (`_forced_at`)."""

    logprob: float  # the reference token's log-probability (a lower bound: see _forced_at)
    top1: bool  # whether it was the server's most likely token
    margin: float | None  # by how much the server preferred its own token (None: unknown)
    chosen: int  # the server's own (most likely) token there


def _forced_at(top: dict[int, float], token: int, chosen: int) -> Forced:
    """The log-probability of `token` where the server chose `chosen`, whether it was the
    server's top-1, and by how much the server preferred `chosen` (None when `token` is not
    among the top TOP_LOGPROBS). A token outside them gets the least of them: its own is
    lower still, so the |Δ| reported is a lower bound."""
    if token not in top:
        return Forced(min(top.values(), default=float("-inf")), False, None, chosen)
    return Forced(top[token], token == chosen, top.get(chosen, top[token]) - top[token], chosen)


def replay_probe(vllm: _Vllm, probe: ProbeRecord) -> Replay:
    """The server's answers for one probe, by the trained prompt's token ids (so a template
    that renders today's date does not change what is compared). Greedy decoding from them
    gives the teacher-forced figures for free while it follows the recorded answer (the same
    prefixes); the positions after the two part are asked one prefix each, in one batched
    request. The server's own rendering of the messages is asked apart (and decoded where it
    differs, for the verdict to tell a date from another template).
    (No `prompt_logprobs`: vLLM 0.32's CPU LoRA kernels fail on it and kill the engine.)"""
    chat: dict[str, Any] = {"messages": probe.messages, "add_generation_prompt": True}
    if probe.tools:
        chat["tools"] = probe.tools
    rendered = vllm.tokens(chat)
    encoded = vllm.tokens({"prompt": probe.prompt_text})
    rendered_text = vllm.text(rendered) if rendered != probe.prompt_ids else probe.prompt_text
    asked = {"temperature": 0, "logprobs": TOP_LOGPROBS, "return_tokens_as_token_ids": True}
    wanted = probe.output_ids
    body = {"prompt": probe.prompt_ids, "max_tokens": len(wanted), **asked}
    [(greedy, tops)] = _steps(vllm.post("/v1/completions", body))
    same = 0
    while same < min(len(greedy), len(wanted)) and greedy[same] == wanted[same]:
        same += 1
    forced = [_forced_at(tops[i], wanted[i], greedy[i]) for i in range(same)]
    if same < len(wanted):
        prefixes = [probe.prompt_ids + wanted[:i] for i in range(same, len(wanted))]
        answer = vllm.post("/v1/completions", {"prompt": prefixes, "max_tokens": 1, **asked})
        forced += [
            _forced_at(top[0], wanted[i], ids[0])
            for i, (ids, top) in zip(range(same, len(wanted)), _steps(answer), strict=True)
        ]
    return Replay(
        rendered_ids=rendered,
        encoded_ids=encoded,
        forced_logprobs=[f.logprob for f in forced],
        forced_top1=[f.top1 for f in forced],
        greedy_ids=greedy,
        forced_margins=[f.margin for f in forced],
        forced_tokens=[f.chosen for f in forced],
        rendered_text=rendered_text,
    )


def served_quantization(engine_args: list[str]) -> str:
    """How vLLM quantises the base as it loads it, from its arguments: `--quantization
    bitsandbytes` quantises in flight to nf4 (vLLM 0.26's bitsandbytes_loader:
    `quantize_4bit(quant_type="nf4", compress_statistics=True)`, the 4-bit weights QLoRA
    trains against); another method by its name; none without the flag. A scan, not vLLM's
    own parser: the supervisor runs vLLM as a process and need not import it."""
    method = "none"
    for i, arg in enumerate(engine_args):
        if arg.startswith("--quantization="):
            method = arg.partition("=")[2]
        elif arg in ("--quantization", "-q") and i + 1 < len(engine_args):
            method = engine_args[i + 1]
    return "nf4" if method == "bitsandbytes" else method


def fitting(reference: Reference, max_model_len: int) -> tuple[Reference, list[str]]:
    """The reference without the probes that cannot fit `max_model_len` (prompt + answer
    tokens), and a note naming those left out."""
    fit = [p for p in reference.probes if len(p.prompt_ids) + len(p.output_ids) <= max_model_len]
    if len(fit) == len(reference.probes):
        return reference, []
    if not fit:
        raise UnreadableReference(
            f"no parity probe fits max_model_len {max_model_len} (the shortest needs "
            f"{min(len(p.prompt_ids) + len(p.output_ids) for p in reference.probes)} tokens)",
        )
    left = len(reference.probes) - len(fit)
    note = f"{left} probe(s) longer than max_model_len {max_model_len} were not replayed"
    return reference.model_copy(update={"probes": fit}), [note]


def check(
    base_url: str,
    model: str,
    reference: Reference,
    *,
    served_dtype: str,
    served_quantization: str = "none",
    served_base_digest: str = "",
    policy: Policy | None = None,
    api_key: str | None = None,
    timeout_s: float = 60.0,
    deadline_s: float = 300.0,
) -> Verdict:
    """Replay `reference` through the vLLM at `base_url` as `model` and judge it: each
    request at most `timeout_s`, the whole replay at most `deadline_s` seconds."""
    vllm = _Vllm(base_url, model, api_key, timeout_s, time.monotonic() + deadline_s)
    with ThreadPoolExecutor(max_workers=min(8, len(reference.probes))) as pool:
        replays = list(pool.map(lambda p: replay_probe(vllm, p), reference.probes))
    return judge(
        model,
        reference,
        replays,
        served_dtype=served_dtype,
        served_quantization=served_quantization,
        served_base_digest=served_base_digest,
        policy=policy,
    )


Outcome = Literal["passed", "refused", "warned", "error_refused", "error_served", "no_reference"]


class ParityVerdict(BaseModel):
    """A check that ran: its verdict as lorastack.parity.Verdict.as_dict writes it (the same
    fields, in that order, rounded as there), and how long the check took."""

    model_config = ConfigDict(frozen=True)

    model: str = Field(description="the served name")
    ok: bool = Field(description="what vLLM serves matched its parity reference")
    policy: Policy = Field(description="what a failure does: refuse or warn")
    served_dtype: str = Field(description="what vLLM computes in")
    precision: str = Field(description="the precisions on both sides, which chose the limits")
    limits: Limits = Field(description="what the answers must keep of the reference")
    probes: int = Field(description="reference prompts replayed")
    positions: int = Field(description="reference tokens compared")
    top1_agreement: float = Field(
        description="fraction of the reference tokens that are still vLLM's most likely token"
    )
    max_abs_logprob_delta: float = Field(
        description="nats: the largest |log-prob served - log-prob trained| of a reference token"
    )
    mean_abs_logprob_delta: float = Field(description="nats: the mean of those |Δ|")
    greedy_identical: int = Field(description="probes whose greedy tokens were all the same")
    greedy_near_ties: int = Field(description="probes whose greedy tokens parted at a near-tie")
    greedy_partings: list[Parting] = Field(
        description="per probe that parted: where, and how sure each side was of its own "
        "token there (nats; null where the other's token is not among its top few)"
    )
    control_distance: float | None = Field(
        description="nats: the base model alone's mean |Δ| from the trained one (the "
        "control); null when the reference carries none"
    )
    control_ratio: float | None = Field(
        description="mean_abs_logprob_delta as a fraction of control_distance"
    )
    problems: list[str] = Field(description="what differs, each with what to change")
    notes: list[str] = Field(description="what differs but does not refuse")
    seconds: float = Field(0.0, description="how long the check took")

    @classmethod
    def of(cls, verdict: Verdict) -> ParityVerdict:
        """The record of `verdict` (its seconds are set where the check is timed)."""
        return cls.model_validate(verdict.as_dict())


class ParityNotRun(BaseModel):
    """A check that could not run (an unreadable reference, vLLM not answering in time, any
    error): the model is served unchecked under parity warn, else refused."""

    model_config = ConfigDict(frozen=True)

    model: str = Field(description="the served name")
    ok: None = Field(None, description="null: no verdict was made")
    served: bool = Field(description="served unchecked (parity warn), else refused")
    error: str = Field(description="why the check could not run")
    seconds: float = Field(0.0, description="how long the attempt took")


class ParityNoReference(BaseModel):
    """Nothing was checked: the folder carries no parity reference (made before references
    were recorded, or with parity_probes: 0), and the model is served."""

    model_config = ConfigDict(frozen=True)

    model: str = Field(description="the served name")
    ok: None = Field(None, description="null: nothing was checked")
    reference: None = Field(None, description="null: the folder has no parity reference")
    seconds: float = Field(0.0, description="how long looking took")


# what ParityChecks keeps per served name: /status shows it under `parity`, /metrics reads it
ParityRecord = ParityVerdict | ParityNotRun | ParityNoReference


@dataclass(frozen=True)
class Checked:
    """What one parity check decided: the outcome, its record, and why a refused model is
    refused."""

    outcome: Outcome
    record: ParityRecord  # under parity: off, a ParityNoReference that is kept nowhere
    reason: str = ""  # why it must not be served ("" when it may)

    @property
    def serve(self) -> bool:
        return self.outcome not in ("refused", "error_refused")


class ParityChecks:
    """The parity checks of one supervisor: each served model or adapter replayed against
    the reference its folder carries, `setting` applied (auto | refuse | warn | off,
    InferenceSettings.parity), the records kept for /status and /metrics. Fails closed: a
    check that cannot run (an unreadable reference, vLLM not answering in time, any error)
    refuses the model unless the policy is warn. Without a reference it is served and the
    record says why nothing was checked."""

    def __init__(
        self,
        setting: str,
        *,
        served_dtype: str,
        api_key: str | None,
        served_quantization: str = "none",
        max_model_len: int = 1 << 30,
        timeout_s: float = 60.0,
        deadline_s: float = 300.0,
    ) -> None:
        self.setting, self.served_dtype, self.api_key = setting, served_dtype, api_key
        self.served_quantization = served_quantization
        self.max_model_len, self.timeout_s, self.deadline_s = max_model_len, timeout_s, deadline_s
        self._lock = threading.Lock()
        self._results: dict[str, ParityRecord] = {}  # served name -> the last check's record
        self.outcomes: dict[Outcome, int] = dict.fromkeys(get_args(Outcome), 0)

    def results(self) -> dict[str, ParityRecord]:
        """A copy of the records so far, by served name."""
        with self._lock:
            return dict(self._results)

    def restore(self, served_name: str, record: ParityRecord | None) -> None:
        """Put back the record of what is served under `served_name` (a new version refused
        in its place leaves the old one served, with its own verdict)."""
        with self._lock:
            if record is None:
                self._results.pop(served_name, None)
            else:
                self._results[served_name] = record

    def check(
        self,
        base_url: str,
        served_name: str,
        folder: Path,
        *,
        served_base_digest: str = "",
        asked_as: str = "",
    ) -> Checked:
        """Check what vLLM at `base_url` serves as `asked_as` (default: `served_name`, the
        name the record is kept under). `served_base_digest`: the base an adapter runs on."""
        if self.setting == "off":
            return Checked("no_reference", ParityNoReference(model=served_name))
        started = time.monotonic()
        checked = self._judge(base_url, served_name, folder, served_base_digest, asked_as)
        seconds = round(time.monotonic() - started, 3)
        record = checked.record.model_copy(update={"seconds": seconds})
        with self._lock:
            self._results[served_name] = record
            self.outcomes[checked.outcome] += 1
        return replace(checked, record=record)

    def _policy(self, reference: Reference | None) -> Policy:
        if self.setting in ("refuse", "warn"):
            return self.setting  # type: ignore[return-value]
        if reference is None:  # unreadable: nothing says it is quantised
            return "refuse"
        return default_policy(reference, self.served_quantization)

    def _judge(
        self,
        base_url: str,
        served_name: str,
        folder: Path,
        served_base_digest: str,
        asked_as: str,
    ) -> Checked:
        reference: Reference | None = None
        try:
            reference = read_reference(folder)
            if reference is None:
                return Checked("no_reference", ParityNoReference(model=served_name))
            judged, notes = fitting(reference, self.max_model_len)
            verdict = check(
                base_url,
                asked_as or served_name,
                judged,
                served_dtype=self.served_dtype,
                served_quantization=self.served_quantization,
                served_base_digest=served_base_digest,
                policy=self._policy(reference),
                api_key=self.api_key,
                timeout_s=self.timeout_s,
                deadline_s=self.deadline_s,
            )
        except (EngineFailed, UnreadableReference) as e:
            return self._could_not(served_name, reference, str(e).replace("\n  hint:", ";"))
        except Exception as e:  # a check that crashes must not leave the model served unjudged
            log.exception("parity check of %s failed", served_name)
            return self._could_not(served_name, reference, f"{type(e).__name__}: {e}")
        verdict.model = served_name
        verdict.notes[:0] = notes
        record = ParityVerdict.of(verdict)
        if verdict.ok:
            log.info("%s", verdict.summary())
            return Checked("passed", record)
        refuse = verdict.policy == "refuse"
        problems = "; ".join(verdict.problems)
        log.log(logging.ERROR if refuse else logging.WARNING, "%s: %s", verdict.summary(), problems)
        if not refuse:
            return Checked("warned", record)
        reason = f"{served_name} differs from the model that was trained: {verdict.problems[0]}"
        return Checked("refused", record, reason)

    def _could_not(self, served_name: str, reference: Reference | None, why: str) -> Checked:
        refuse = self._policy(reference) == "refuse"
        record = ParityNotRun(model=served_name, served=not refuse, error=why)
        if not refuse:
            log.warning("parity of %s could not be checked (served: parity warn): %s",
                        served_name, why)  # fmt: skip
            return Checked("error_served", record)
        log.error("parity of %s could not be checked, so it is refused: %s", served_name, why)
        reason = f"the parity check of {served_name} could not run: {why}"
        return Checked("error_refused", record, reason)
