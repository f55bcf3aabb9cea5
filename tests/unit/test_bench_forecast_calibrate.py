"""``bench_forecast.py --calibrate``: a correction fitted on one week's ``--dump`` and scored on another's."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from bench_forecast import adjusted, calibrate, long_rows, scored

H = 3_600_000_000  # an hour in µs


def _row(allocated: bool, actual_h: float, forecast_h: float | None, other_h: float | None = None) -> dict[str, Any]:
    est: dict[str, int | None] = {"forecast": None if forecast_h is None else round(forecast_h * H)}
    if other_h is not None:
        est["other"] = round(other_h * H)
    return {"job_id": "j", "submitted": 0, "actual": round(actual_h * H), "estimates": est, "allocated": allocated}


# waits over an hour (the 0.5 h one is left out); within 25% of the wait by the unallocated factor:
#   unallocated 4 h, forecast 2 h: x1 2 h (off 2 > 1), x1.25 2.5 h (1.5), x1.5 3 h (1.0: in), x1.75 (in), x2 (in)
#   unallocated 2 h, forecast 1.5 h: x1 (0.5 <= 0.5: in), x1.25 (0.125: in), x1.5 (0.25: in), x1.75 (0.625), x2 (1.0)
#   allocated 10 h, forecast 9 h: never scaled, off 1 h <= 2.5 h: in at every factor
#   unallocated 3 h with no start: a miss at every factor
ROWS = [_row(False, 4, 2), _row(False, 2, 1.5), _row(True, 10, 9), _row(False, 3, None), _row(False, 0.5, 0.1)]


def _dump(path: Path, rows: list[dict[str, Any]]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def test_long_rows_leaves_out_waits_of_an_hour_or_less(tmp_path: Path) -> None:
    rows = long_rows(_dump(tmp_path / "w.jsonl", [*ROWS, _row(False, 1.0, 1.0)]))
    assert [r["actual"] for r in rows] == [4 * H, 2 * H, 10 * H, 3 * H]


def test_the_factor_scales_only_unallocated_waits() -> None:
    assert adjusted(_row(False, 4, 2), "forecast", None, 1.5) == 3 * H
    assert adjusted(_row(True, 4, 2), "forecast", None, 1.5) == 2 * H
    assert adjusted(_row(False, 4, None), "forecast", None, 1.5) is None


def test_the_blend_is_a_point_between_the_two_estimates() -> None:
    # 2 h and 6 h: a quarter of the way 3 h, half 4 h, twice as far 10 h; none where either is none
    r = _row(False, 5, 2, 6)
    assert [adjusted(r, "forecast", "other", w) for w in (0.25, 0.5, 2.0)] == [3 * H, 4 * H, 10 * H]
    assert adjusted(_row(False, 5, None, 6), "forecast", "other", 0.5) is None


@pytest.mark.parametrize(("factor", "hits", "median_h"), [(1.0, 2, 1.0), (1.5, 3, 1.0), (2.0, 2, 1.0)])
def test_scored_counts_within_a_quarter_of_the_wait(factor: float, hits: int, median_h: float) -> None:
    # x1 errors 2, 0.5, 1 -> median 1; x1.5: 1, 0.25, 1 -> 1; x2: 0, 1, 1 -> 1 (the no-start row has no error)
    long = [r for r in ROWS if r["actual"] - r["submitted"] > H]
    assert scored(long, "forecast", None, factor) == (hits, pytest.approx(median_h))


def test_calibrate_fits_on_the_first_file_and_scores_the_others(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fit = _dump(tmp_path / "fit.jsonl", ROWS)
    # the other week: unallocated 8 h forecast 4 h: x1.5 6 h (off 2 = 25%: in), x1 off 4; allocated 2 h at 2 h: in
    other = _dump(tmp_path / "other.jsonl", [_row(False, 8, 4), _row(True, 2, 2)])
    calibrate(fit, [other], "forecast", None)
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith("forecast, unallocated waits x 1.5")  # 3 of 4; every other factor 2
    fit_line, other_line = out[2].split(), out[3].split()
    assert fit_line[1:] == ["4", "2", "1.00", "3", "1.00"]
    # errors x1: 4 and 0 h, x1.5: 2 and 0 h; the median of two is the upper one
    assert other_line[1:] == ["2", "1", "4.00", "2", "2.00"]
