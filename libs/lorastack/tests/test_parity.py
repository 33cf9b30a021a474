"""The parity verdict over plain data (lorastack.parity): what differs is named, the limits
follow the precisions, and `auto` serves in a dtype chosen on purpose."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from lorastack.parity import (
    EXACT,
    HALF,
    MIN_CONTROL,
    ProbeRecord,
    Reference,
    Replay,
    UnreadableReference,
    default_policy,
    describe,
    judge,
    limits_for,
    read_reference_bytes,
    serving_dtype,
)

RIVAL = 99  # the token a served model may prefer where the reference parts from it


def reference(
    dtype: str = "float32",
    quantization: str = "none",
    probes: int = 4,
    length: int = 3,
    rival_margin: float = 0.5,
    base_gap: float = 3.0,
) -> Reference:
    """A format-2 reference: at every position RIVAL is the trained model's runner-up,
    `rival_margin` nats behind; the base alone gives each reference token `base_gap` nats
    less (the control)."""
    lps = [(-0.01, -0.2, -0.05)[j % 3] for j in range(length)]
    return Reference(
        recorded_by="trainer",
        dtype=dtype,
        quantization=quantization,
        base_digest="sha256:" + "a" * 64,
        max_new_tokens=8,
        probes=[
            ProbeRecord(
                messages=[{"role": "user", "content": f"q{i}"}],
                prompt_text=f"<user>q{i}<assistant>",
                prompt_ids=[1, 10 + i, 2],
                output_ids=list(range(5, 5 + length)),
                output_logprobs=lps,
                output_text="abc",
                output_top=[{5 + j: lp, RIVAL: lp - rival_margin} for j, lp in enumerate(lps)],
                base_logprobs=[lp - base_gap for lp in lps],
            )
            for i in range(probes)
        ],
    )


def faithful(ref: Reference, shift: float = 0.0) -> list[Replay]:
    """What a server that serves the trained model gives (log-probs moved by `shift`)."""
    return [
        Replay(
            rendered_ids=list(p.prompt_ids),
            encoded_ids=list(p.prompt_ids),
            forced_logprobs=[lp + shift for lp in p.output_logprobs],
            forced_top1=[True] * len(p.output_ids),
            greedy_ids=list(p.output_ids),
            forced_margins=[0.0] * len(p.output_ids),
            forced_tokens=list(p.output_ids),
        )
        for p in ref.probes
    ]


def test_the_served_trained_model_passes_with_its_numbers() -> None:
    ref = reference()
    v = judge("m", ref, faithful(ref, shift=1e-4), served_dtype="float32")
    assert v.ok and not v.problems
    assert v.top1_agreement == 1.0 and v.greedy_identical == 4 and v.positions == 12
    assert v.max_abs_logprob_delta == pytest.approx(1e-4)
    assert v.limits == EXACT and v.precision == "recorded in float32, served in float32"


def test_a_different_chat_template_is_named() -> None:
    ref = reference()
    replays = [
        Replay([1, 99, *r.rendered_ids[1:]], r.encoded_ids, r.forced_logprobs, r.forced_top1, [8])
        for r in faithful(ref)
    ]
    v = judge("m", ref, replays, served_dtype="float32")
    assert not v.ok and "chat template" in v.problems[0] and "--chat-template" in v.problems[0]


def test_a_different_tokenizer_is_named_before_the_template() -> None:
    ref = reference()
    replays = [
        Replay([3, 4], [3, 4], r.forced_logprobs, r.forced_top1, r.greedy_ids)
        for r in faithful(ref)
    ]
    v = judge("m", ref, replays, served_dtype="float32")
    assert not v.ok and "tokenizer" in v.problems[0]
    assert not any("chat template" in p for p in v.problems)


def test_an_adapter_on_another_base_is_named_and_its_numbers_fail() -> None:
    ref = reference()
    replays = [
        Replay(r.rendered_ids, r.encoded_ids, [-6.0, -5.0, -7.0], [False, False, True], [9, 9])
        for r in faithful(ref)
    ]
    v = judge("m", ref, replays, served_dtype="float32", served_base_digest="sha256:" + "b" * 64)
    assert not v.ok
    assert (
        "trained on base sha256:aaaa" in v.problems[0] and "served on sha256:bbbb" in v.problems[0]
    )
    assert "top-1 agreement 33.3%" in v.problems[1] and "greedy identical on 0/4" in v.problems[1]


@pytest.mark.parametrize(
    ("ref_dtype", "served", "quantization", "limits"),
    [
        ("float32", "float32", "none", EXACT),
        ("float32", "float16", "none", HALF),
        ("bfloat16", "bfloat16", "none", HALF),
        ("float32", "float32", "nf4", HALF),
    ],
)
def test_limits_follow_both_precisions(
    ref_dtype: str, served: str, quantization: str, limits: object
) -> None:
    assert limits_for(reference(ref_dtype, quantization), served) == limits


def test_half_precision_tolerates_rounding_but_float32_does_not() -> None:
    """A 0.04-nat move (under 1% of the base's distance) and one probe parted at a
    two-sided near-tie: bf16's rounding, a wrong weight in fp32."""
    for dtype, ok in (("bfloat16", True), ("float32", False)):
        ref = reference(dtype, base_gap=5.0)
        replays = faithful(ref, shift=0.04)
        replays[0] = parted(replays[0], 2, 0.3)
        v = judge("m", ref, replays, served_dtype=dtype)
        assert v.ok is ok, v.problems
        if not ok:
            assert "mean |Δ log-prob| 0.040 > 0.01" in v.problems[0]
            assert "the weights served are not the weights trained" in v.problems[0]


def parted(replay: Replay, at: int, margin: float | None) -> Replay:
    """`replay` whose greedy answer parts from the reference at token `at` for RIVAL, which
    the server preferred by `margin` nats (None: the reference's not in its top few)."""
    top1 = [i != at for i in range(len(replay.forced_top1))]
    margins = [0.0 if hit else margin for hit in top1]
    tokens = [t if hit else RIVAL for t, hit in zip(replay.forced_tokens, top1, strict=True)]
    greedy = [*replay.greedy_ids[:at], RIVAL]
    return dataclasses.replace(
        replay, forced_top1=top1, forced_margins=margins, forced_tokens=tokens, greedy_ids=greedy
    )


def test_greedy_parting_at_near_ties_is_rounding_but_at_clear_preferences_is_not() -> None:
    """Half precision (the Llama-3.1-8B shape in bf16, bench/parity): every probe may part
    where bf16 decided a near-tie the other way; a served model that parts where it clearly
    prefers another token is not the trained one, though each position alone mostly agrees."""
    ref = reference("bfloat16", probes=8, length=32)  # as the trainer records: 32 tokens each
    ties = [parted(r, 2, 0.4) for r in faithful(ref, shift=0.005)]
    v = judge("m", ref, ties, served_dtype="bfloat16")
    assert v.ok, v.problems
    assert (v.greedy_identical, v.greedy_near_ties) == (0, 8)
    assert [(p.server_margin, p.reference_margin) for p in v.partings] == [(0.4, 0.5)] * 8
    assert "greedy identical 0/8 (+8 parted at a near-tie)" in v.summary()

    clear = [parted(r, 2, 4.0) if i < 3 else r for i, r in enumerate(faithful(ref, shift=0.005))]
    v = judge("m", ref, clear, served_dtype="bfloat16")
    assert not v.ok and v.top1_agreement == pytest.approx(253 / 256)  # 3 misses of 256
    assert (
        "greedy identical on 5/8 probes, 0 more parted at a two-sided near-tie" in (v.problems[0])
    )

    unknown = [parted(r, 0, None) if i < 3 else r for i, r in enumerate(faithful(ref))]
    v = judge("m", ref, unknown, served_dtype="bfloat16")
    assert v.greedy_near_ties == 0 and [p.server_margin for p in v.partings] == [None] * 3
    assert "greedy identical on 5/8" in v.problems[0]


def test_a_parting_where_the_trained_model_was_sure_is_no_tie() -> None:
    """The reviewer's model: one digit of every answer changed, its own digit preferred by
    1.4 nats (within the server-side limit), where the trained model put it 6 nats behind."""
    sure = reference("bfloat16", probes=8, length=10, rival_margin=6.0)
    digit = [parted(r, 4, 1.4) for r in faithful(sure, shift=0.005)]
    v = judge("m", sure, digit, served_dtype="float16")
    assert not v.ok and v.greedy_near_ties == 0, v.as_dict()
    assert [(p.server_margin, p.reference_margin) for p in v.partings] == [(1.4, 6.0)] * 8
    # the same parting where the trained model was unsure too (0.5 nats) is rounding
    unsure = reference("bfloat16", probes=8, length=10, rival_margin=0.5)
    assert judge("m", unsure, [parted(r, 4, 1.4) for r in faithful(unsure, 0.005)],
                 served_dtype="float16").ok  # fmt: skip
    # the server's token outside the trained model's top few: no tie either
    ref = reference("bfloat16", probes=8, length=10)
    outside = [dataclasses.replace(parted(r, 4, 0.2), forced_tokens=[7] * 10)
               for r in faithful(ref)]  # fmt: skip
    assert judge("m", ref, outside, served_dtype="float16").greedy_near_ties == 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("kept", [0.0, 0.5, 0.75, 0.98])
def test_a_model_between_the_trained_one_and_its_base_is_refused(dtype: str, kept: float) -> None:
    """The control: log-probs a share `kept` of the way to the base alone's (0: the base;
    0.5: the adapter at half scale; 0.98: 2% of the base's distance left, as the demo
    adapter at 75% of its scale keeps 1.7%), the greedy answers unchanged. Refused in every
    precision."""
    ref = reference(dtype, probes=8, length=10, base_gap=2.0)
    replays = [
        dataclasses.replace(
            r,
            forced_logprobs=[
                lp + (1 - kept) * (b - lp)
                for lp, b in zip(p.output_logprobs, p.base_logprobs, strict=True)
            ],
        )
        for p, r in zip(ref.probes, faithful(ref), strict=True)
    ]
    v = judge("m", ref, replays, served_dtype=dtype)
    assert (
        not v.ok and "of the base model's distance from the trained one remains" in (v.problems[0])
    ), v.problems
    assert v.control_ratio == pytest.approx(1 - kept)


def test_the_control_is_not_applied_where_the_probes_do_not_tell_adapter_from_base() -> None:
    ref = reference("bfloat16", base_gap=MIN_CONTROL / 2)
    v = judge("m", ref, faithful(ref, shift=0.1), served_dtype="bfloat16")
    assert v.ok and "barely tell the trained model from its base" in v.notes[0], v.as_dict()


def test_rounding_under_the_floor_is_no_missing_adapter() -> None:
    """A weak control (0.3 nats): bf16's rounding (0.005 nats a token) is 1.7% of it, over
    the 1.2% limit, but under the floor of what rounding alone gives: it passes."""
    ref = reference("bfloat16", base_gap=0.3)
    v = judge("m", ref, faithful(ref, shift=0.005), served_dtype="bfloat16")
    assert v.ok and v.control_ratio == pytest.approx(0.005 / 0.3), v.as_dict()


def test_a_template_that_renders_todays_date_is_a_note_not_a_refusal() -> None:
    ref = reference()
    for p in ref.probes:
        p.prompt_text = f"Today Date: 26 Jul 2024\n{p.prompt_text}"
    replays = [
        dataclasses.replace(
            r,
            rendered_ids=[*r.rendered_ids, 7],
            rendered_text=p.prompt_text.replace("26 Jul 2024", "7 Dec 2026"),
        )
        for p, r in zip(ref.probes, faithful(ref), strict=True)
    ]
    v = judge("m", ref, replays, served_dtype="float32")
    assert v.ok and "renders today's date" in v.notes[0], v.as_dict()
    # any other difference in the rendering is the template's
    other = [dataclasses.replace(r, rendered_text="You are helpful.\n" + r.rendered_text)
             for r in replays]  # fmt: skip
    v = judge("m", ref, other, served_dtype="float32")
    assert not v.ok and "chat template renders the trained prompts differently" in v.problems[0]


@pytest.mark.parametrize(
    ("edit", "named"),
    [
        (lambda d: d["probes"][0]["output_logprobs"].__setitem__(0, float("nan")), "finite"),
        (lambda d: d["probes"][0]["base_logprobs"].__setitem__(0, float("-inf")), "finite"),
        (lambda d: d["probes"][0]["output_logprobs"].__setitem__(0, None), "valid number"),
        (lambda d: d["probes"][0]["output_logprobs"].pop(), "2 output_logprobs for 3"),
        (lambda d: d["probes"][0]["output_top"].pop(), "2 output_top for 3"),
        (lambda d: d["probes"][0]["output_logprobs"].__setitem__(0, 0.5), "above 0"),
        (lambda d: d.__setitem__("format", 3), "format 3 is not one this lorastack reads"),
        (lambda d: d.__setitem__("probes", []), "at least 1 item"),
    ],
)
def test_a_hostile_reference_is_unreadable_with_its_cause(edit: Any, named: str) -> None:
    data = json.loads(reference().model_dump_json())
    edit(data)
    with pytest.raises(UnreadableReference, match=r"ref\.json is not a parity reference") as e:
        read_reference_bytes(json.dumps(data).encode(), "ref.json")
    assert named in str(e.value)
    with pytest.raises(UnreadableReference, match="not JSON"):
        read_reference_bytes(b"\xff{", "ref.json")


def test_float32_accepts_only_ties_within_its_summation_order() -> None:
    ref = reference("float32", probes=40, rival_margin=0.05)  # 1 miss in 120: top-1 99.2%
    replays = faithful(ref)
    replays[0] = parted(replays[0], 1, 0.05)  # both tokens moved by 0.025 at most: a tie
    assert judge("m", ref, replays, served_dtype="float32").ok
    replays[0] = parted(replays[0], 1, 0.3)
    v = judge("m", ref, replays, served_dtype="float32")
    assert not v.ok and v.greedy_near_ties == 0


@pytest.mark.parametrize(
    ("trained", "served", "precision", "hint"),
    [
        ("nf4", "none", "on a nf4 base, served in bfloat16", "[--quantization, bitsandbytes]"),
        ("none", "nf4", "in bfloat16, served in bfloat16 on a nf4 base", "serve it unquantised"),
        ("nf4", "nf4", "on a nf4 base, served in bfloat16 on a nf4 base", "merge and verify"),
    ],
)
def test_a_quantised_base_on_either_side_is_named_and_warned_about(
    trained: str, served: str, precision: str, hint: str
) -> None:
    """QLoRA served on vLLM's own 4-bit base (--quantization bitsandbytes): closer than on the
    unquantised one (bench/parity: top-1 89% against 7%), yet other kernels: warned."""
    ref = reference("bfloat16", quantization=trained)
    v = judge(
        "m", ref, faithful(ref, shift=4.0), served_dtype="bfloat16", served_quantization=served
    )
    assert not v.ok and v.policy == "warn" and v.limits == HALF
    assert v.precision.endswith(precision) and hint in v.problems[0], v.problems


def test_a_dtype_mismatch_says_which_dtype_to_serve() -> None:
    ref = reference("float32")
    replays = faithful(ref, shift=4.0)
    v = judge("m", ref, replays, served_dtype="bfloat16")
    assert not v.ok and "serve it in float32" in v.problems[0]


def test_a_quantised_reference_is_warned_about_and_an_unquantised_one_refused() -> None:
    assert default_policy(reference(quantization="nf4")) == "warn"
    assert default_policy(reference()) == "refuse"
    ref = reference(quantization="nf4")
    v = judge("m", ref, faithful(ref, shift=5.0), served_dtype="bfloat16")
    assert not v.ok and v.policy == "warn" and "nf4 base" in v.problems[0]
    assert judge("m", ref, faithful(ref, 5.0), served_dtype="bfloat16", policy="refuse").policy == (
        "refuse"
    )


def test_replays_must_match_the_probes() -> None:
    ref = reference()
    with pytest.raises(ValueError, match="3 replays for 4 probes"):
        judge("m", ref, faithful(ref)[:3], served_dtype="float32")


@pytest.mark.parametrize(
    ("platform", "checkpoint", "lora", "refs", "dtype"),
    [
        ("cpu", "float32", True, ["bfloat16"], "float32"),
        ("cuda", "bfloat16", True, ["bfloat16"], "bfloat16"),
        ("cuda", "float32", True, ["float32"], "float16"),  # vLLM's LoRA kernels: 16-bit
        ("cuda", "float32", False, ["float32"], "float32"),  # a float32 merge, checked so
        ("cuda", "float32", False, ["bfloat16"], "float16"),  # a merge of a GPU-trained adapter
        ("cuda", "float32", False, [], "bfloat16"),  # nothing to go by: vLLM's own auto
        # LoRA on, the adapters loaded later (the demo): as when they are listed at start
        ("cuda", "float32", True, [], "float16"),
    ],
)
def test_auto_serves_in_a_dtype_chosen_on_purpose(
    platform: str, checkpoint: str, lora: bool, refs: list[str], dtype: str
) -> None:
    chosen, why = serving_dtype(
        [reference(d) for d in refs], platform=platform, checkpoint_dtype=checkpoint, with_lora=lora
    )
    assert chosen == dtype and why


def test_a_verdict_reads_as_one_line_wherever_it_is_shown() -> None:
    ref = reference(quantization="nf4")
    warned = judge("m", ref, faithful(ref, shift=5.0), served_dtype="bfloat16")
    assert describe(warned.as_dict()) == warned.summary()
    assert warned.summary().startswith("parity m: FAIL (warned); top-1 100.0% of 12 tokens")
    assert describe({"model": "b", "ok": None, "reference": None}) == (
        "parity b: not checked (it carries no parity reference)"
    )


def test_a_qlora_reference_recorded_on_the_served_base_is_held_to_refusal() -> None:
    """A QLoRA adapter's reference recorded on the unquantised base it is served on
    (trainer.publish.reference): the same limits and policy as any adapter, so what the
    nf4-recorded reference let through with a warning (bench/compose: the right adapter at
    top-1 80% there) is now a near miss refused; served on vLLM's 4-bit base the hint says
    that the reference was recorded unquantised."""
    ref = reference("bfloat16").model_copy(update={"trained_quantization": "nf4"})
    assert default_policy(ref) == "refuse"
    assert judge("m", ref, faithful(ref), served_dtype="bfloat16").ok
    near = judge("m", ref, faithful(ref, shift=0.5), served_dtype="bfloat16")
    assert not near.ok and near.policy == "refuse" and near.limits == HALF, near.problems
    on_nf4 = judge(
        "m", ref, faithful(ref, shift=4.0), served_dtype="bfloat16", served_quantization="nf4"
    )
    assert "recorded on the unquantised base (trained on nf4)" in on_nf4.problems[0]
