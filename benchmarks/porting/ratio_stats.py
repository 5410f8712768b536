"""Intervals for the ratios the porting benchmarks report."""

from __future__ import annotations

import math
import statistics


def median_interval95(values: list[float]) -> list[float]:
    """The median's 95% interval without assuming a distribution: the order statistics n/2 -+ 1.96 sqrt(n)/2."""
    ordered, n = sorted(values), len(values)
    half = 1.96 * math.sqrt(n) / 2
    return [round(ordered[max(0, math.floor(n / 2 - half))], 4), round(ordered[min(n - 1, math.ceil(n / 2 + half))], 4)]


def interval95(values: list[float]) -> list[float]:
    """The mean's 95% interval (Student's t, two-sided) from the values' spread."""
    t975 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23,
            11: 2.20, 12: 2.18, 13: 2.16, 14: 2.14, 15: 2.13, 16: 2.12, 17: 2.11, 18: 2.10, 19: 2.09,
            20: 2.09, 21: 2.08, 22: 2.07, 23: 2.07, 24: 2.06, 25: 2.06, 26: 2.06, 27: 2.05, 28: 2.05, 29: 2.05}
    n = len(values)
    if n < 2:
        return [values[0], values[0]] if values else []
    half = t975.get(n - 1, 2.04 if n <= 41 else 1.98) * statistics.stdev(values) / math.sqrt(n)
    mean = statistics.fmean(values)
    return [round(mean - half, 4), round(mean + half, 4)]
