"""Verdict logic on synthetic paired data with known answers, and the small-n cases that
a percentile bootstrap alone called "improvement" (issue #38)."""

from __future__ import annotations

import numpy as np
import pytest

from evaluation.verdict import decide, minimum_items, paired_bootstrap
from lorastack.errors import ConfigError


def _paired(n: int, p_base: float, p_cand: float, seed: int) -> tuple[list[float], list[float]]:
    rng = np.random.default_rng(seed)
    return (
        (rng.random(n) < p_base).astype(float).tolist(),
        (rng.random(n) < p_cand).astype(float).tolist(),
    )


def test_known_improvement() -> None:
    base, cand = _paired(200, 0.2, 0.7, seed=1)  # true difference +0.5
    r = paired_bootstrap(base, cand, seed=0)
    assert r.verdict == "improvement"
    assert 0.3 < r.ci_low < r.ci_high < 0.8
    assert r.ci_low < r.mean_difference < r.ci_high
    assert r.n == 200 and r.wins + r.losses + r.ties == 200


def test_known_regression() -> None:
    base, cand = _paired(200, 0.8, 0.4, seed=2)  # true difference -0.4
    r = paired_bootstrap(base, cand, seed=0)
    assert r.verdict == "regression"
    assert r.ci_high < -0.25


def test_pure_noise_is_uncertain() -> None:
    # both models are coin flips of the same bias: any observed gap is noise
    uncertain = 0
    for seed in range(20):
        base, cand = _paired(100, 0.5, 0.5, seed=100 + seed)
        r = paired_bootstrap(base, cand, seed=seed)
        uncertain += r.verdict == "uncertain"
        assert r.ci_low < r.mean_difference < r.ci_high
    assert uncertain >= 17  # a 95% interval misses 0 in about 1 case of 20


def test_identical_scores_are_uncertain() -> None:
    r = paired_bootstrap([1.0, 0.0, 1.0] * 3, [1.0, 0.0, 1.0] * 3)
    assert (r.ci_low, r.ci_high, r.verdict, r.p_value) == (0.0, 0.0, "uncertain", 1.0)


def test_small_sample_is_too_few_even_with_a_gap() -> None:
    r = paired_bootstrap([0.0, 1.0, 0.0, 1.0], [1.0, 1.0, 0.0, 0.0])
    assert r.verdict == "too few items"


@pytest.mark.parametrize(
    ("baseline", "candidate", "p_value"),
    [
        ([0.0], [1.0], 1.0),  # one item: the old percentile CI was (1, 1), "improvement"
        ([0.0, 0.0], [1.0, 1.0], 0.5),
        ([0.0, 0.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0, 1.0], 0.125),  # 4 wins, 1 tie
    ],
)
def test_too_few_items_is_never_an_improvement(
    baseline: list[float], candidate: list[float], p_value: float
) -> None:
    r = paired_bootstrap(baseline, candidate)
    assert r.verdict == "too few items" and r.min_items == 6
    # exact two-sided binomial: 2 * 0.5**wins, ties dropped (1 win -> 1.0, 2 -> 0.5, 4 -> 0.125)
    assert r.p_value == pytest.approx(p_value, rel=1e-12)
    assert r.wins == len(baseline) - r.ties and r.losses == 0


def test_minimum_items_is_the_smallest_n_a_sign_test_can_decide() -> None:
    # n wins of n untied items is the most extreme outcome: two-sided p = 2 * 0.5**n
    assert minimum_items(0.95) == 6  # 2 * 0.5**5 = 0.0625 >= 0.05 > 0.03125 = 2 * 0.5**6
    assert minimum_items(0.99) == 8  # 0.0156 >= 0.01 > 0.0078
    assert minimum_items(0.9) == 5  # 0.125 >= 0.1 > 0.0625
    six = paired_bootstrap([0.0] * 6, [1.0] * 6)
    assert six.verdict == "improvement" and six.p_value == pytest.approx(2 * 0.5**6)
    # six items but one tie: five untied wins give p = 0.0625, not enough
    assert paired_bootstrap([0.0] * 5 + [1.0], [1.0] * 6).verdict == "uncertain"


def test_the_demos_split_keeps_its_improvement() -> None:
    # the demo evaluates exact match on its frozen test split: 200 chats x test 0.1, ~20
    # items, where the base model gets ~1 right and the LoRA ~19. Worst pairing: the one the
    # base gets right is the one the LoRA misses (19 wins, 1 loss): p = 2 * 21 / 2**20
    base = [1.0] + [0.0] * 19
    lora = [0.0] + [1.0] * 19
    r = paired_bootstrap(base, lora)
    assert r.verdict == "improvement" and r.p_value == pytest.approx(2 * 21 / 2**20, rel=1e-12)
    assert r.ci_method == "BCa" and 0 < r.ci_low < r.mean_difference < r.ci_high


def test_equal_models_rarely_look_improved() -> None:
    # 400 seeded evaluations of two equal models (each item right with p = 0.5 for both,
    # n = 30). The sign test alone calls "improvement" with probability <= alpha / 2 =
    # 2.5% (exact, one direction of a two-sided test), and the rule also needs the BCa
    # interval above 0, so the rate can only be lower. The bound asserted is 5% = 20 of
    # 400: the expected count at 2.5% is 10, sd sqrt(400 * 0.025 * 0.975) = 3.1, so 20 is
    # over 3 sd above it, and the data are seeded, so the count is fixed on every machine.
    rng = np.random.default_rng(38)
    improved = 0
    for i in range(400):
        base = (rng.random(30) < 0.5).astype(float)
        cand = (rng.random(30) < 0.5).astype(float)
        improved += paired_bootstrap(base, cand, seed=i, resamples=500).verdict == "improvement"
    assert improved / 400 <= 0.05, improved


def test_seeded_and_paired() -> None:
    base, cand = _paired(50, 0.3, 0.6, seed=3)
    assert paired_bootstrap(base, cand, seed=7) == paired_bootstrap(base, cand, seed=7)
    # pairing matters: a constant +1 shift has a zero-width interval
    shifted = paired_bootstrap([0.0] * 10, [1.0] * 10)
    assert (shifted.ci_low, shifted.ci_high) == (1.0, 1.0)


def test_wider_confidence_gives_wider_interval() -> None:
    base, cand = _paired(80, 0.4, 0.55, seed=4)
    r90 = paired_bootstrap(base, cand, confidence=0.90)
    r99 = paired_bootstrap(base, cand, confidence=0.99)
    assert r99.ci_low <= r90.ci_low and r99.ci_high >= r90.ci_high


@pytest.mark.parametrize(
    ("low", "high", "p", "wins", "losses", "verdict"),
    [(0.01, 0.2, 0.01, 9, 1, "improvement"), (-0.2, -0.01, 0.01, 1, 9, "regression"),
     (-0.1, 0.1, 0.01, 9, 1, "uncertain"), (0.0, 0.3, 0.01, 9, 1, "uncertain"),
     (-0.3, 0.0, 0.01, 1, 9, "uncertain"),
     (0.01, 0.2, 0.06, 9, 1, "uncertain"),  # the interval says yes, the exact test no
     (-0.2, -0.01, 0.06, 1, 9, "uncertain")],
)  # fmt: skip
def test_decide(low: float, high: float, p: float, wins: int, losses: int, verdict: str) -> None:
    assert decide(low, high, p_value=p, alpha=0.05, wins=wins, losses=losses) == verdict


def test_bad_input() -> None:
    with pytest.raises(ConfigError, match="differ in shape"):
        paired_bootstrap([1.0], [1.0, 0.0])
    with pytest.raises(ConfigError, match="no paired items"):
        paired_bootstrap([], [])
    with pytest.raises(ConfigError, match="too few"):
        paired_bootstrap([1.0], [0.0], resamples=10)
