"""Verdict logic on synthetic paired data with known answers."""

from __future__ import annotations

import numpy as np
import pytest

from evaluation.verdict import decide, paired_bootstrap
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
    r = paired_bootstrap([1.0, 0.0, 1.0], [1.0, 0.0, 1.0])
    assert (r.ci_low, r.ci_high, r.verdict) == (0.0, 0.0, "uncertain")


def test_small_sample_is_uncertain_even_with_a_gap() -> None:
    r = paired_bootstrap([0.0, 1.0, 0.0, 1.0], [1.0, 1.0, 0.0, 0.0])
    assert r.verdict == "uncertain"


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
    ("low", "high", "verdict"),
    [(0.01, 0.2, "improvement"), (-0.2, -0.01, "regression"), (-0.1, 0.1, "uncertain"),
     (0.0, 0.3, "uncertain"), (-0.3, 0.0, "uncertain")],
)  # fmt: skip
def test_decide(low: float, high: float, verdict: str) -> None:
    assert decide(low, high) == verdict


def test_bad_input() -> None:
    with pytest.raises(ConfigError, match="differ in shape"):
        paired_bootstrap([1.0], [1.0, 0.0])
    with pytest.raises(ConfigError, match="no paired items"):
        paired_bootstrap([], [])
    with pytest.raises(ConfigError, match="too few"):
        paired_bootstrap([1.0], [0.0], resamples=10)
