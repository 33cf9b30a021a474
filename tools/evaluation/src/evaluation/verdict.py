"""Verdicts from paired data: a BCa bootstrap interval and an exact sign test, both from scipy.

For each test item i we have a baseline score a_i and a candidate score b_i (same item,
same scorer), so the difference d_i = b_i - a_i is the unit of evidence. Two methods
whose error rates hold at small n decide together:

    interval    `scipy.stats.bootstrap(method="BCa")` of mean(d), `resamples` resamples
                (BCa corrects the bias and skew that make a percentile interval too
                narrow at small n)
    exact test  `scipy.stats.binomtest` on wins vs losses, ties dropped (a two-sided sign
                test: it assumes nothing about the scores' scale or distribution)

    too few items   n < minimum_items(confidence): no test of this size can reach
                    p < 1 - confidence, so the data cannot say "improvement"
    improvement     the interval is above 0 and the sign test says p < 1 - confidence,
                    more wins than losses
    regression      the interval is below 0 and p < 1 - confidence, more losses than wins
    uncertain       anything else (the methods disagree, or the data cannot tell)

Pure logic over numbers, no I/O. The same seed and data give the same interval.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Literal

import numpy as np
from pydantic import BaseModel
from scipy import stats

from lorastack.errors import ConfigError

Verdict = Literal["improvement", "regression", "uncertain", "too few items"]
CiMethod = Literal["BCa", "percentile", "exact"]


def minimum_items(confidence: float) -> int:
    """The fewest paired items for which the sign test can reach p < alpha = 1 - confidence.

    The most extreme outcome of n untied items is n wins; its two-sided exact p-value is
    2 * 0.5**n. That is below alpha only when n > 1 + log2(1 / alpha): at the default
    confidence 0.95, n = 5 gives 0.0625 and n = 6 gives 0.03125, so 6 is the minimum
    (0.99 needs 8). Fewer items cannot show an improvement, whatever the scores.
    """
    alpha = 1.0 - confidence
    n = 1
    while 2 * 0.5**n >= alpha:  # p-value of n wins out of n, two-sided
        n += 1
    return n


class PairedResult(BaseModel):
    """One metric's paired comparison: both means, the CI of the difference, wins/losses/ties,
    the sign test and the verdict."""

    n: int  # paired items
    baseline_mean: float
    candidate_mean: float
    mean_difference: float  # candidate - baseline
    ci_low: float
    ci_high: float
    confidence: float  # e.g. 0.95
    resamples: int
    seed: int
    wins: int  # items where the candidate scored higher
    losses: int  # items where the baseline scored higher
    ties: int
    verdict: Verdict
    # None in reports written before the exact test was part of the rule (promote refuses
    # those: their verdict rested on a percentile bootstrap alone)
    p_value: float | None = None  # two-sided exact sign test on wins vs losses
    min_items: int | None = None  # minimum_items(confidence) when this was decided
    ci_method: CiMethod = "percentile"


def decide(
    ci_low: float, ci_high: float, *, p_value: float, alpha: float, wins: int, losses: int
) -> Verdict:
    """Both methods must agree, in the same direction, for a verdict other than uncertain."""
    if p_value < alpha and ci_low > 0 and wins > losses:
        return "improvement"
    if p_value < alpha and ci_high < 0 and losses > wins:
        return "regression"
    return "uncertain"


def sign_test(wins: int, losses: int) -> float:
    """Two-sided exact binomial p-value of wins among the untied items (1.0 when all tie)."""
    if wins + losses == 0:
        return 1.0
    return float(stats.binomtest(wins, wins + losses, 0.5, alternative="two-sided").pvalue)


def bca_interval(
    d: np.ndarray, *, confidence: float, resamples: int, seed: int
) -> tuple[float, float, CiMethod]:
    """BCa interval of mean(d); exact when every difference is equal (no spread to resample)."""
    if np.all(d == d[0]):
        return float(d[0]), float(d[0]), "exact"
    with warnings.catch_warnings():
        # scipy warns and returns NaN where the BCa correction is undefined (e.g. every
        # resample on one side of the observed mean); that case falls back below
        warnings.simplefilter("ignore", stats.DegenerateDataWarning)
        res = stats.bootstrap(
            (d,),
            np.mean,
            n_resamples=resamples,
            confidence_level=confidence,
            method="BCa",
            rng=np.random.default_rng(seed),
        )
    low, high = float(res.confidence_interval.low), float(res.confidence_interval.high)
    if math.isnan(low) or math.isnan(high):
        alpha = 1.0 - confidence
        low, high = (
            float(q) for q in np.quantile(res.bootstrap_distribution, [alpha / 2, 1 - alpha / 2])
        )
        return low, high, "percentile"
    return low, high, "BCa"


def _check_pairs(a: np.ndarray, b: np.ndarray, *, confidence: float, resamples: int) -> None:
    """Raise ConfigError unless `a` and `b` are paired scores a bootstrap can compare."""
    if a.shape != b.shape or a.ndim != 1:
        raise ConfigError(
            f"paired scores differ in shape: {a.shape} vs {b.shape}",
            "score the same items with both models",
        )
    if a.size == 0:
        raise ConfigError(
            "no paired items to compare", "the test split must hold at least one item"
        )
    if not 0.5 < confidence < 1:
        raise ConfigError(f"confidence {confidence} is out of range", "use e.g. 0.95")
    if resamples < 100:
        raise ConfigError(f"{resamples} resamples is too few", "use at least 100 (default 2000)")


def paired_bootstrap(
    baseline: Sequence[float],
    candidate: Sequence[float],
    *,
    confidence: float = 0.95,
    resamples: int = 2000,
    seed: int = 0,
) -> PairedResult:
    """The interval of mean(candidate - baseline), the sign test, and their verdict."""
    a = np.asarray(baseline, dtype=np.float64)
    b = np.asarray(candidate, dtype=np.float64)
    _check_pairs(a, b, confidence=confidence, resamples=resamples)
    d = b - a
    n = d.size
    wins, losses = int((d > 0).sum()), int((d < 0).sum())
    p_value = sign_test(wins, losses)
    low, high, method = bca_interval(d, confidence=confidence, resamples=resamples, seed=seed)
    floor = minimum_items(confidence)
    verdict: Verdict = (
        "too few items"
        if n < floor
        else decide(low, high, p_value=p_value, alpha=1 - confidence, wins=wins, losses=losses)
    )
    return PairedResult(
        n=n,
        baseline_mean=float(a.mean()),
        candidate_mean=float(b.mean()),
        mean_difference=float(d.mean()),
        ci_low=low,
        ci_high=high,
        confidence=confidence,
        resamples=resamples,
        seed=seed,
        wins=wins,
        losses=losses,
        ties=n - wins - losses,
        verdict=verdict,
        p_value=p_value,
        min_items=floor,
        ci_method=method,
    )
