"""The orders PyTorch's schedules actually run, as the strategy builds them — without processes.

Each rank is traced alone in a fake world (``support.schedule_trace``); the ranks'
traces are then replayed together against the pipeline's data dependencies, with forward cost 1
and backward cost 2.
"""

import pytest

from support.schedule_trace import in_flight_peak, simulate, trace_rank

VIRTUAL = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2, "zero_bubble": 2}


def _orders(schedule, pp, m):
    return {
        rank: trace_rank(
            schedule, pp_size=pp, virtual=VIRTUAL[schedule], micro_batches=m, rank=rank
        )
        for rank in range(pp)
    }


@pytest.mark.parametrize("schedule", list(VIRTUAL))
@pytest.mark.parametrize("pp, m", [(2, 4), (4, 8)])
def test_every_chunk_runs_once_in_dependency_order(schedule, pp, m):
    orders = _orders(schedule, pp, m)
    virtual = VIRTUAL[schedule]
    for rank, order in orders.items():
        stages = {rank + v * pp for v in range(virtual)}  # looped placement
        kinds = ("F", "B", "W") if schedule == "zero_bubble" else ("F", "B")
        assert sorted(order) == sorted((k, s, mb) for k in kinds for s in stages for mb in range(m))
        for kind, stage, mb in order:  # backward of a chunk after its forward, on this rank
            if kind != "F":
                assert order.index(("F", stage, mb)) < order.index((kind, stage, mb))
    simulate(orders)  # raises if the ranks' orders deadlock


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("pp, m", [(2, 4), (2, 8), (4, 4), (4, 16)])
def test_bubble_is_the_textbook_fraction(schedule, pp, m):
    bubble = simulate(_orders(schedule, pp, m))["bubble"]
    assert all(b == pytest.approx((pp - 1) / (m + pp - 1)) for b in bubble.values())


@pytest.mark.parametrize("pp, m", [(2, 4), (2, 8), (4, 8)])
def test_interleaved_and_zero_bubble_idle_less_than_1f1b(pp, m):
    one_f_one_b = max(simulate(_orders("1f1b", pp, m))["bubble"].values())
    interleaved = max(simulate(_orders("interleaved_1f1b", pp, m))["bubble"].values())
    zero_bubble = max(simulate(_orders("zero_bubble", pp, m))["bubble"].values())
    assert zero_bubble < interleaved < one_f_one_b
    # v stages per rank: (p - 1) / (v m + p - 1)
    assert interleaved == pytest.approx((pp - 1) / (2 * m + pp - 1))


@pytest.mark.parametrize("pp, m", [(2, 8), (4, 8)])
def test_1f1b_keeps_at_most_p_micro_batches_in_flight(pp, m):
    one_f_one_b, gpipe = _orders("1f1b", pp, m), _orders("gpipe", pp, m)
    assert [in_flight_peak(one_f_one_b[r]) for r in range(pp)] == [pp - r for r in range(pp)]
    assert [in_flight_peak(gpipe[r]) for r in range(pp)] == [m] * pp


def test_a_deadlocking_order_is_caught():
    # Backward before forward.
    orders = {0: [("F", 0, 0), ("B", 0, 0)], 1: [("B", 1, 0), ("F", 1, 0)]}
    with pytest.raises(RuntimeError, match="deadlocks"):
        simulate(orders)
