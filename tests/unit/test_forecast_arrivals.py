"""The forward run with replayed arrivals is not spaced (``D12.job-forecast``, ``forecast --with-arrivals``).

Hand-built states (:class:`tests.kit.forecast_history.History`: tree ``lab`` with ``a`` and ``b`` at 0.5 each);
every expected time is worked out in the case's comment.
"""

from __future__ import annotations

from apportion import events as ev
from apportion.forecast import forecast
from tests.kit.builders import T0, h, m
from tests.kit.forecast_history import CFG, History

SEC = 1_000_000  # µs


def _arrival(job_id: str, at: int) -> tuple[int, ev.JobQueued]:
    """A 1-GPU job of lab/b, 10 minutes of work, submitted at ``at``: the dispatcher's ``JobQueued`` of it, as an
    ``arrivals`` entry."""
    log = History().submit(job_id, at, budget="lab/b", duration_s=600.0, tick=False).log
    return at, next(e for e in log if isinstance(e, ev.JobQueued))


def test_a_forward_run_with_arrivals_is_not_spaced() -> None:
    # one 2-GPU node; r1 (1 h of work) and r2 (1 h 1 min) run from T0; p1 and p2 (1 GPU each, lab/a) wait; now
    # T0 + 20 min, no periodic cycle. Spaced 5%, the cycle at r1's end (T0 + 1 h, 40 min after now) leaves a gap of
    # 5% of 2,400 s = 120 s, so p2, waiting for r2's end at T0 + 1 h 1 min, starts at T0 + 1 h 2 min. With an
    # arrival (x1 at T0 + 5 h, after both have started, so it moves no decision) the run is not spaced: p2 starts
    # at r2's end, T0 + 1 h 1 min, and the forecast says its spacing is 0.
    hist = History().node("n0", 2).submit("r1", T0, duration_s=3600.0).submit("r2", T0, duration_s=3660.0)
    hist.submit("p1", m(10)).submit("p2", m(11))
    spaced = forecast(hist.state, m(20), CFG, cycle_s=None, spacing=0.05)
    assert ({j.job_id: j.start_us for j in spaced.jobs}, spaced.spacing) == ({"p1": h(1), "p2": h(1) + 120 * SEC}, 0.05)
    replayed = forecast(hist.state, m(20), CFG, cycle_s=None, spacing=0.05, arrivals=[_arrival("x1", h(5))])
    assert {j.job_id: j.start_us for j in replayed.jobs} == {"p1": h(1), "p2": h(1) + 60 * SEC}
    assert (replayed.spacing, replayed.to_dict()["spacing"]) == (0.0, 0.0)
