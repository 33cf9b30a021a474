"""Verdicts from paired data: a seeded paired bootstrap of the mean per-sample difference.

For each test item i we have a baseline score a_i and a candidate score b_i (same item,
same scorer), so the difference d_i = b_i - a_i is the unit of evidence. The bootstrap
resamples items (with replacement) `resamples` times and takes the mean of d each time;
the central `confidence` share of those means is the confidence interval (percentile
method). The verdict follows the interval alone:

    improvement   lower bound > 0     (the candidate is better on this data)
    regression    upper bound < 0     (the candidate is worse)
    uncertain     the interval contains 0 (this data cannot tell them apart)

Pure numpy, no I/O. The same seed and data give the same interval.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np
from pydantic import BaseModel

from lorastack.errors import ConfigError

Verdict = Literal["improvement", "regression", "uncertain"]
_CHUNK = 256  # resamples drawn at once: bounds memory to _CHUNK * n indices


class PairedResult(BaseModel):
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


def decide(ci_low: float, ci_high: float) -> Verdict:
    if ci_low > 0:
        return "improvement"
    if ci_high < 0:
        return "regression"
    return "uncertain"


def paired_bootstrap(
    baseline: Sequence[float],
    candidate: Sequence[float],
    *,
    confidence: float = 0.95,
    resamples: int = 2000,
    seed: int = 0,
) -> PairedResult:
    """Bootstrap CI of mean(candidate - baseline) over paired items, and its verdict."""
    a = np.asarray(baseline, dtype=np.float64)
    b = np.asarray(candidate, dtype=np.float64)
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
    d = b - a
    n = d.size
    rng = np.random.default_rng(seed)
    means = np.empty(resamples)
    for start in range(0, resamples, _CHUNK):
        k = min(_CHUNK, resamples - start)
        idx = rng.integers(0, n, size=(k, n))
        means[start : start + k] = d[idx].mean(axis=1)
    alpha = 1.0 - confidence
    low, high = np.quantile(means, [alpha / 2, 1 - alpha / 2])
    return PairedResult(
        n=n,
        baseline_mean=float(a.mean()),
        candidate_mean=float(b.mean()),
        mean_difference=float(d.mean()),
        ci_low=float(low),
        ci_high=float(high),
        confidence=confidence,
        resamples=resamples,
        seed=seed,
        wins=int((d > 0).sum()),
        losses=int((d < 0).sum()),
        ties=int((d == 0).sum()),
        verdict=decide(float(low), float(high)),
    )
