"""Figures from pairs of measurements: the median of their ratios, and how sure it is."""

from __future__ import annotations

import math


def sign_test_interval(values: list[float], confidence: float = 0.90) -> tuple[float, float]:
    """A distribution-free interval for the median: the k-th smallest and k-th largest of
    ``values``, k the largest with P(Binomial(n, 1/2) < k) <= (1 - confidence) / 2."""
    ordered = sorted(values)
    n = len(ordered)
    tail, k = 0.0, 0
    while k < n // 2:
        tail += math.comb(n, k) / 2**n
        if tail > (1 - confidence) / 2:
            break
        k += 1
    k = max(k, 1)
    return ordered[k - 1], ordered[n - k]
