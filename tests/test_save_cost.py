"""trigger/cost.py: the moving average of what a save costs."""

from __future__ import annotations

import pytest

from smartckpt_cli.trigger.cost import WEIGHT, SaveCost


def test_nothing_saved_costs_nothing() -> None:
    cost = SaveCost()
    assert (cost.wait, cost.total) == (0.0, 0.0)


def test_first_save_is_taken_as_it_is() -> None:
    cost = SaveCost()
    cost.add(0.25, 4.0)
    assert (cost.wait, cost.total) == (0.25, 4.0)


def test_later_saves_weigh_three_tenths() -> None:
    cost = SaveCost()
    cost.add(1.0, 10.0)
    cost.add(2.0, 20.0)
    assert WEIGHT == 0.3
    assert cost.wait == pytest.approx(0.7 * 1.0 + 0.3 * 2.0)
    assert cost.total == pytest.approx(0.7 * 10.0 + 0.3 * 20.0)
    cost.add(0.0, 0.0)
    assert cost.wait == pytest.approx(0.7 * 1.3)
    assert cost.total == pytest.approx(0.7 * 13.0)


def test_a_slow_first_save_fades() -> None:
    cost = SaveCost()
    cost.add(5.0, 50.0)  # cold start: allocation, page cache
    for _ in range(20):
        cost.add(0.1, 1.0)
    assert cost.wait == pytest.approx(0.1, abs=0.01)
    assert cost.total == pytest.approx(1.0, abs=0.05)
    assert cost.total < 1.05


def test_one_slow_save_moves_the_average_by_its_weight_only() -> None:
    cost = SaveCost()
    for _ in range(10):
        cost.add(0.1, 1.0)
    cost.add(0.1, 11.0)
    assert cost.total == pytest.approx(1.0 + 0.3 * 10.0)


def test_until_a_save_took_time_the_newest_counts_alone() -> None:
    cost = SaveCost()
    cost.add(0.5, 0.0)  # a total of zero (a clock too coarse) does not start the average
    cost.add(0.2, 3.0)
    assert (cost.wait, cost.total) == (0.2, 3.0)


def test_the_schedule_moves_with_takes_commits_and_failures():
    """engine/schedule.py: the training thread takes, the save thread commits or fails (both
    under one lock): a failure or a commit of non-finite weights moves what the trigger schedules
    from back to the newest committed checkpoint."""
    from smartckpt_cli.engine.schedule import SaveSchedule

    sched = SaveSchedule(0.0)
    sched.taken(5, 1.0)
    v = sched.view()
    assert (v.scheduled_step, v.committed_step) == (5, None)
    sched.failed()  # the save of step 5 did not commit: back to the newest committed
    assert sched.view().scheduled_step is None
    sched.taken(10, 2.0)
    sched.committed(10, 2.0, healthy=True, wait=0.1, total=1.0)
    v = sched.view()
    assert (v.scheduled_step, v.committed_step, v.save_wait, v.save_total) == (10, 10, 0.1, 1.0)
    sched.taken(20, 3.0)
    sched.committed(20, 3.0, healthy=False, wait=0.1, total=1.0)  # non-finite: not counted
    assert (sched.view().scheduled_step, sched.view().committed_step) == (10, 10)
