"""The live latency run's p50 by quarter (``bench/bench_live.py``): whether its warm-up was long enough."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from bench_live import quarter_medians


def test_each_quarter_in_order() -> None:
    # 8 values, 2 a quarter: medians (9+7)/2, (5+3)/2, 2, (1+0)/2
    assert quarter_medians([9.0, 7.0, 5.0, 3.0, 2.0, 2.0, 1.0, 0.0]) == [8.0, 4.0, 2.0, 0.5]


def test_uneven_quarters_split_by_floor() -> None:
    # 6 values: cuts at 6k//4 = 0, 1, 3, 4, 6 -> [10], [20, 30], [40], [50, 60]
    assert quarter_medians([10.0, 20.0, 30.0, 40.0, 50.0, 60.0]) == [10.0, 25.0, 40.0, 55.0]


def test_fewer_values_than_quarters() -> None:
    # 2 values: cuts 0, 0, 1, 1, 2 -> two empty quarters left out
    assert quarter_medians([4.0, 6.0]) == [4.0, 6.0]
    assert quarter_medians([]) == []
