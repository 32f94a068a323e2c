"""The pipeline bubble model with stage times and hand-off (benchmarks/pp_bubble_parts.py), against the closed form."""

from __future__ import annotations

import pytest

from benchmarks.pp_bubble_parts import bubble_model, schedule_orders
from framework.base.cost.bubble import pp_bubble_fraction


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("pp, m", [(2, 2), (2, 4), (2, 8), (4, 8)])
def test_equal_stages_free_handoff_give_the_narayanan_bubble(schedule, pp, m):
    orders = schedule_orders(schedule, pp=pp, m=m)
    dur = {(k, s): (0.0 if k == "L" else (1.0 if k == "F" else 2.0)) for k in "FBL" for s in range(pp)}
    idle = bubble_model(orders, dur=dur, handoff_s=0.0, gap_s=0.0, pp=pp)
    # The first rank idles the Narayanan bubble: its step spans (m + p - 1)(f + b).
    assert idle[0] == pytest.approx(pp_bubble_fraction(pp=pp, n_microbatches=m))
    # Rank r's own step ends r backwards earlier (the measurement times each rank's schedule.step):
    # idle_r = 1 - m(f + b) / ((m + p - 1)(f + b) - r·b), less than the formula on every later rank.
    f, b = 1.0, 2.0
    assert idle == pytest.approx([1 - m * (f + b) / ((m + pp - 1) * (f + b) - r * b) for r in range(pp)])


def test_a_slower_last_stage_and_a_handoff_follow_the_critical_path():
    """p = 2, 1F1B: the last stage is the bottleneck, so rank 0's step is f0 + c + m·(f1 + loss + b1) + c + b0
    and rank 1's ends after its last backward, at f0 + c + m·(f1 + loss + b1)."""
    f0, b0, f1, b1, loss, c, m = 1.0, 2.0, 1.5, 3.0, 0.5, 0.25, 4
    dur = {("F", 0): f0, ("B", 0): b0, ("F", 1): f1, ("B", 1): b1, ("L", 1): loss, ("L", 0): 0.0}
    idle = bubble_model(schedule_orders("1f1b", pp=2, m=m), dur=dur, handoff_s=c, gap_s=0.0, pp=2)
    wall1 = f0 + c + m * (f1 + loss + b1)
    wall0 = wall1 + c + b0
    assert idle == pytest.approx([1 - m * (f0 + b0) / wall0, 1 - m * (f1 + b1) / wall1])


@pytest.mark.parametrize("m", [2, 4, 8])
def test_torch_interleaved_order_with_equal_chunks_gives_the_interleaved_bubble(m):
    """torch's ScheduleInterleaved1F1B order (v = 2 chunks per rank) reaches (p-1)/(v·m+p-1) on the first rank."""
    from benchmarks.pp_bubble_parts import interleaved_orders

    orders = interleaved_orders(pp=2, v=2, m=m)
    dur = {(k, s): {"F": 1.0, "B": 2.0, "L": 0.0}[k] for k in "FBL" for s in range(4)}
    idle = bubble_model(orders, dur=dur, handoff_s=0.0, gap_s=0.0, pp=2)
    assert idle[0] == pytest.approx(pp_bubble_fraction(pp=2, n_microbatches=m, virtual_stages=2))
