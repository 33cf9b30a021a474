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
- greedy decoding on the server's own rendering of the prompt vs the reference tokens; where
  the two part, how strongly the server preferred its own token there (`Replay.forced_margins`):
  a near-tie that rounding decided the other way, or a real difference (vLLM's own model
  tests accept a parting whose tokens are in each other's top few, `check_logprobs_close`;
  this asks for a margin in nats, so a parting at a clear preference is not accepted).

The limits depend on the precisions on both sides (`limits_for`): float32 on both sides
may differ only by the kernels' summation order; a half-precision side rounds every
weight and activation to 8 (bfloat16) or 11 (float16) significant bits, which moves
log-probabilities by tenths of a nat and flips near-ties; a reference recorded on a
4-bit (nf4) base and served unquantised differs by the quantisation itself, so it is
judged by the half-precision limits and only warned about by default.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, Field

REFERENCE_FILE = "parity-reference.json"
HALF_DTYPES = ("bfloat16", "float16")

Policy = Literal["refuse", "warn"]


class ProbeRecord(BaseModel):
    """One held-out prompt and what the trained model generated from it."""

    messages: list[dict[str, Any]]  # the conversation up to the reply (OpenAI chat format)
    tools: list[dict[str, Any]] | None = None  # OpenAI tools, when the template renders them
    prompt_text: str  # the prompt as the chat template rendered it
    prompt_ids: list[int]  # ... and as the tokenizer encoded it
    output_ids: list[int]  # greedy continuation, its stop token included when it stopped
    output_logprobs: list[float]  # nats: log-probability of each output token
    output_text: str  # output_ids decoded, special tokens skipped


class Reference(BaseModel):
    """The model as trained and evaluated, and its answers to the probes."""

    format: Literal[1] = 1
    recorded_by: str  # "trainer" or "merger"
    dtype: str  # compute dtype the model ran in: float32 | bfloat16 | float16
    quantization: str = "none"  # of the base weights: none | nf4
    device: str = ""  # cpu | cuda
    base_digest: str = ""  # the base model the adapter was trained on
    max_new_tokens: int = Field(ge=1)
    probes: list[ProbeRecord] = Field(min_length=1)


@dataclass(frozen=True)
class Replay:
    """What the server gave for one probe (inference.parity asks it)."""

    rendered_ids: list[int]  # the server's chat template over probe.messages, tokenised
    encoded_ids: list[int]  # the server's tokenizer over probe.prompt_text
    forced_logprobs: list[float]  # teacher-forced log-probability of each output token
    forced_top1: list[bool]  # ... and whether it was the server's most likely token
    greedy_ids: list[int]  # greedy decoding from rendered_ids
    # per output token: the server's top-1 log-prob minus the reference token's (0 where it
    # is the top-1; None where the reference token is not among the server's top few)
    forced_margins: list[float | None] = field(default_factory=list)


@dataclass(frozen=True)
class Limits:
    """What a served model's answers must keep of the parity reference."""

    min_top1: float  # fraction of reference tokens still the server's top-1
    max_abs_logprob: float  # nats, largest |Δ log-prob| of a reference token
    max_tie_margin: float  # nats: a greedy parting where the server preferred its own token
    # by no more than this is a near-tie decided the other way, not a difference
    min_greedy_agree: float  # fraction of probes whose greedy tokens are all equal, or part
    # from the reference's only at a near-tie


# float32 on both sides: vLLM's and Hugging Face's kernels sum in other orders (~1e-6
# relative), which moves a log-prob by about 1e-4 nats; 0.05 leaves room for a long
# sequence's accumulation and still catches a wrong weight, which moves whole nats. A tie
# flips only when both of its tokens moved: 2 x 0.05.
EXACT = Limits(min_top1=0.99, max_abs_logprob=0.05, max_tie_margin=0.1, min_greedy_agree=1.0)
# A half-precision side rounds each weight and activation to 8 (bf16) or 11 (fp16)
# significant bits: log-probs move by tenths of a nat (measured: up to 0.12 for SmolLM2
# served in bf16, 0.70 for the Llama-3.1-8B layer shape, bench/parity), near-ties flip, and
# a greedy text parts for good after its first flip. Each token of a flipped tie moved by
# up to ~0.75 nats, hence a margin of 1.5; a swapped base, template or adapter moves most
# tokens by whole nats and parts at clear preferences, far outside these.
HALF = Limits(min_top1=0.9, max_abs_logprob=3.0, max_tie_margin=1.5, min_greedy_agree=0.75)


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
    often. Without any reference, as vLLM's own `auto`: bfloat16."""
    if platform == "cpu":
        return "float32", "vLLM's CPU build runs float32 (bfloat16 is slower without AVX-512)"
    if checkpoint_dtype != "float32":
        return checkpoint_dtype, f"the checkpoint's dtype ({checkpoint_dtype})"
    if not references:
        return "bfloat16", "a float32 checkpoint without a parity reference (as vLLM's auto)"
    if not with_lora and all(r.dtype == "float32" for r in references):
        return "float32", "a float32 checkpoint whose parity reference was recorded in float32"
    return "float16", (
        "a float32 checkpoint served "
        + (
            "with LoRA adapters (vLLM's LoRA kernels take 16-bit weights only)"
            if with_lora
            else "after training in 16-bit"
        )
        + ": float16 keeps 11 significant bits to bfloat16's 8"
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
    # per probe that parted: the server's margin (nats) for its own token where it parted;
    # None where the reference token was not among the server's top few (not a tie)
    greedy_parted_margins: list[float | None] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # each: what differs; what to change

    def as_dict(self) -> dict[str, Any]:
        """The verdict as a JSON-ready dict."""
        return {
            "model": self.model,
            "ok": self.ok,
            "policy": self.policy,
            "served_dtype": self.served_dtype,
            "precision": self.precision,
            "limits": {
                "min_top1": self.limits.min_top1,
                "max_abs_logprob": self.limits.max_abs_logprob,
                "max_tie_margin": self.limits.max_tie_margin,
                "min_greedy_agree": self.limits.min_greedy_agree,
            },
            "probes": self.probes,
            "positions": self.positions,
            "top1_agreement": round(self.top1_agreement, 4),
            "max_abs_logprob_delta": round(self.max_abs_logprob_delta, 4),
            "mean_abs_logprob_delta": round(self.mean_abs_logprob_delta, 4),
            "greedy_identical": self.greedy_identical,
            "greedy_near_ties": self.greedy_near_ties,
            "greedy_parted_margins": [
                None if m is None else round(m, 4) for m in self.greedy_parted_margins
            ],
            "problems": self.problems,
        }

    def summary(self) -> str:
        """One line: the verdict and its numbers (`describe`)."""
        return describe(self.as_dict())


def describe(record: dict[str, Any]) -> str:
    """One line of a verdict as /status shows it (Verdict.as_dict), or why none was made."""
    name = record["model"]
    if record.get("ok") is None:
        why = record.get("error") or "it carries no parity reference"
        return f"parity {name}: not checked ({why})"
    if record["ok"]:
        state = "pass"
    else:
        state = "FAIL (refused)" if record["policy"] == "refuse" else "FAIL (warned)"
    ties = record.get("greedy_near_ties", 0)
    parted = f" (+{ties} parted at a near-tie)" if ties else ""
    return (
        f"parity {name}: {state}; top-1 {record['top1_agreement']:.1%} of "
        f"{record['positions']} tokens, max |Δ log-prob| {record['max_abs_logprob_delta']:.3f}, "
        f"greedy identical {record['greedy_identical']}/{record['probes']}{parted} "
        f"({record['precision']})"
    )


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
    problems: list[str] = []
    if served_base_digest and reference.base_digest and served_base_digest != reference.base_digest:
        problems.append(
            f"the adapter was trained on base {reference.base_digest[:19]} but is served on "
            f"{served_base_digest[:19]}: serve it on the base it was trained on"
        )
    if any(r.encoded_ids != p.prompt_ids for p, r in zip(reference.probes, replays, strict=True)):
        problems.append(
            "the server's tokenizer encodes the trained prompts differently: serve the "
            "model's own tokenizer (the artifact's tokenizer files; vLLM --tokenizer)"
        )
    elif any(
        r.rendered_ids != p.prompt_ids for p, r in zip(reference.probes, replays, strict=True)
    ):
        problems.append(
            "the server's chat template renders the trained prompts differently: serve the "
            "template the model was trained with (the artifact's chat_template.jinja; "
            "vLLM --chat-template)"
        )
    deltas = [
        abs(got - want)
        for p, r in zip(reference.probes, replays, strict=True)
        for got, want in zip(r.forced_logprobs, p.output_logprobs, strict=True)
    ]
    top1 = [hit for r in replays for hit in r.forced_top1]
    positions = len(deltas)
    agreement = sum(top1) / len(top1) if top1 else 1.0
    max_delta = max(deltas, default=0.0)
    mean_delta = math.fsum(deltas) / positions if positions else 0.0
    pairs = list(zip(reference.probes, replays, strict=True))
    identical = sum(r.greedy_ids == p.output_ids for p, r in pairs)
    parted = [_parting_margin(r) for p, r in pairs if r.greedy_ids != p.output_ids]
    near_ties = sum(m is not None and m <= limits.max_tie_margin for m in parted)
    agree = identical + near_ties
    numeric = []
    if agreement < limits.min_top1:
        numeric.append(f"top-1 agreement {agreement:.1%} < {limits.min_top1:.0%}")
    if max_delta > limits.max_abs_logprob:
        numeric.append(f"max |Δ log-prob| {max_delta:.3f} > {limits.max_abs_logprob}")
    if agree < limits.min_greedy_agree * len(replays):
        numeric.append(
            f"greedy identical on {identical}/{len(replays)} probes, "
            f"{near_ties} more parted at a near-tie (<= {limits.max_tie_margin} nats): "
            f"{agree}/{len(replays)} < {limits.min_greedy_agree:.0%}"
        )
    if numeric:
        problems.append(
            f"{'; '.join(numeric)} ({precision}): "
            + _numeric_hint(reference, served_dtype, served_quantization)
        )
    return Verdict(
        model=model,
        ok=not problems,
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
        greedy_parted_margins=parted,
        problems=problems,
    )


def _parting_margin(replay: Replay) -> float | None:
    """The server's margin for its own token where its greedy answer parted from the
    reference's: at the first reference token that is not the server's top-1 (the greedy
    answer follows the reference up to there when the prompts agree). None where no such
    token is known (no teacher-forced miss, or the reference token outside the top few)."""
    for i, top1 in enumerate(replay.forced_top1):
        if not top1:
            return replay.forced_margins[i] if i < len(replay.forced_margins) else None
    return None


def _numeric_hint(reference: Reference, served_dtype: str, served_quantization: str) -> str:
    trained, served = reference.quantization, served_quantization
    if trained != "none" and served == "none":
        return (
            f"the adapter was trained on a {trained} base and is served on the unquantised "
            "one; the gap is the quantisation's (merge and verify, or serve the base "
            "quantised as it was trained: extra_vllm_args [--quantization, bitsandbytes])"
        )
    if trained == "none" and served != "none":
        return (
            f"it was trained on an unquantised base and is served on a {served} one: serve "
            "it unquantised (no --quantization in extra_vllm_args)"
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
