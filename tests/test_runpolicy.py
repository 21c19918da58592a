"""runpolicy: the supervisor's decisions as pure functions (no processes)."""

from __future__ import annotations

import signal

import pytest

from smartckpt_cli.config import parse_every
from smartckpt_cli.supervise.policy import (
    BACKOFF_CAP,
    FIRST_STEP_TIMEOUT,
    HANG_FLOOR,
    WARMUP_TIMEOUT,
    AttemptEnd,
    CrashLoop,
    HangClock,
    backoff,
    classify,
    estimate_mtbf,
    exit_status,
    learned_timeout,
)


def err(t: str, m: str = "boom") -> dict:
    return {"type": t, "message": m, "traceback": ""}


def test_exit_zero_is_done():
    assert classify(AttemptEnd(0, True)).action == "done"
    assert classify(AttemptEnd(0, None)).exit_code == 0


@pytest.mark.parametrize("etype", ["SyntaxError", "ImportError", "ModuleNotFoundError", "NameError"])
def test_non_retryable_errors_stop_with_the_childs_code(etype):
    out = classify(AttemptEnd(1, True, err(etype)))
    assert (out.action, out.category, out.exit_code) == ("stop", "non-retryable", 1)
    assert etype in out.cause and "same way" in out.cause


def test_user_patterns_stop_even_after_progress():
    out = classify(AttemptEnd(7, True, err("ValueError", "bad config key lr")), patterns=[r"bad config"])
    assert out.action == "stop" and "bad config" in out.cause and out.exit_code == 7
    assert classify(AttemptEnd(7, True, err("ValueError", "other"))).action == "restart"


def test_failure_before_the_first_step_stops():
    out = classify(AttemptEnd(1, False, err("RuntimeError", "no data")))
    assert (
        out.action == "stop"
        and out.category == "no-progress"
        and "before its first training step" in out.cause
    )
    # no heartbeat at all and a plain exit code: nothing says it ever trained
    assert classify(AttemptEnd(3, None)).action == "stop"
    # killed by a signal before the first step: still stop, code 128+9
    out = classify(AttemptEnd(-signal.SIGKILL, False))
    assert out.action == "stop" and out.exit_code == 137


def test_retryable_causes_restart():
    assert classify(AttemptEnd(-signal.SIGKILL, True)).category == "signal"
    assert classify(AttemptEnd(-signal.SIGKILL, None)).action == "restart"  # unknown progress, external kill
    assert classify(AttemptEnd(-signal.SIGKILL, True, oom=True)).category == "oom"
    cuda = classify(AttemptEnd(1, True, err("RuntimeError", "CUDA error: an illegal memory access")))
    assert (cuda.action, cuda.category) == ("restart", "gpu")
    nccl = classify(AttemptEnd(1, True, err("torch.distributed.DistBackendError", "NCCL error: unhandled")))
    assert nccl.category == "gpu"
    assert classify(AttemptEnd(-signal.SIGKILL, True, hung=True)).category == "hang"
    assert classify(AttemptEnd(1, True, err("RuntimeError", "x"))).category == "failed"


def test_forwarded_and_preempted_signals():
    out = classify(AttemptEnd(-signal.SIGTERM, True, forwarded=signal.SIGTERM))
    assert (out.action, out.exit_code) == ("signalled", 143)
    out = classify(AttemptEnd(-signal.SIGUSR1, True, preempted=signal.SIGUSR1))
    assert out.action == "preempted"
    assert exit_status(-15) == 143 and exit_status(4) == 4
    # a child that exits with a code of its own after a forwarded Ctrl-C (torchrun exits 1): 130
    assert classify(AttemptEnd(1, True, forwarded=signal.SIGINT)).exit_code == 130
    # one killed after the grace period keeps what killed it
    assert classify(AttemptEnd(-signal.SIGKILL, True, forwarded=signal.SIGINT)).exit_code == 137


def test_backoff_doubles_and_caps():
    assert [backoff(n, 2.0) for n in (1, 2, 3, 4)] == [2.0, 4.0, 8.0, 16.0]
    assert backoff(30, 2.0) == BACKOFF_CAP
    assert backoff(0, 2.0) == 0.0 and backoff(3, 0.0) == 0.0


def test_crash_loop_rolls_back_once_then_stops():
    cl = CrashLoop(limit=3)
    assert cl.record(0, 20) == "restart"  # first attempt got to checkpoint 20, then died
    assert cl.record(20, 20) == "restart"  # stuck 1
    assert cl.record(20, 20) == "restart"  # stuck 2
    assert cl.record(20, 20) == "rollback"  # stuck 3: roll back to the previous checkpoint
    # from the previous checkpoint (10) it commits 20 again and dies at the same place
    assert cl.record(10, 20) == "stop"


def test_crash_loop_resets_when_the_rollback_helps():
    cl = CrashLoop(limit=2)
    assert cl.record(20, 20) == "restart"
    assert cl.record(20, 20) == "rollback"
    assert cl.record(10, 30) == "restart"  # got past the loop
    assert cl.record(30, 30) == "restart"
    assert cl.record(30, 30) == "stop"  # a second loop: the one rollback is spent


def test_crash_loop_counts_only_the_same_checkpoint():
    cl = CrashLoop(limit=3)
    assert cl.record(10, 10) == "restart"
    assert cl.record(10, 10) == "restart"
    assert cl.record(20, 20) == "restart"  # another checkpoint: the count starts over
    assert cl.stuck == 1


def test_hang_clock_first_step_warmup_learned_and_paused():
    c = HangClock()
    c.start(0.0)
    c.observe(100, False, 0.0)  # restored step 100, no step yet
    assert c.timeout() == FIRST_STEP_TIMEOUT
    assert not c.hung(FIRST_STEP_TIMEOUT - 1) and c.hung(FIRST_STEP_TIMEOUT + 1)
    t = 10.0
    c.observe(101, False, t)
    assert c.timeout() == WARMUP_TIMEOUT  # stepped, not warmed up
    for s in range(102, 112):
        t += 2.0
        c.observe(s, False, t)
    assert c.timeout() == max(HANG_FLOOR, 10 * 2.0)
    for s in range(112, 122):
        t += 9.0
        c.observe(s, False, t)
    assert c.timeout() == pytest.approx(90.0)  # 10 x the slowest recent step
    assert c.hung(t + 91) and not c.hung(t + 89)
    c.observe(121, True, t)  # saving: paused
    assert c.timeout() is None and not c.hung(t + 10_000)
    c.observe(121, False, t + 500)  # resumed: the clock restarts from the resume
    assert not c.hung(t + 550)


def test_hang_clock_override():
    c = HangClock(override=5.0)
    c.start(0.0)
    c.observe(0, False, 0.0)
    assert c.timeout() == max(FIRST_STEP_TIMEOUT, 50.0)
    c.observe(1, False, 1.0)
    assert c.timeout() == 5.0 and c.hung(6.5)


def test_learned_timeout_floor():
    assert learned_timeout([0.01, 0.02]) == HANG_FLOOR
    assert learned_timeout([1.0, 30.0], factor=3, floor=1) == 90.0


def test_parse_every():
    assert parse_every("50") == (50, None)
    assert parse_every("30s") == (None, 30.0)
    assert parse_every("5m") == (None, 300.0)
    assert parse_every("1h") == (None, 3600.0)
    for bad in ("0", "x", "-3", "5 parsecs", "0s"):
        with pytest.raises(ValueError):
            parse_every(bad)


def test_estimate_mtbf():
    assert estimate_mtbf([]) is None
    rec = {"attempts": [
        {"started": 0, "ended": 3600, "category": "signal"},
        {"started": 3600, "ended": 7200, "category": "hang"},
        {"started": 7200, "ended": 10800, "category": "done"},
    ]}  # fmt: skip
    assert estimate_mtbf([rec]) == 5400.0
    assert estimate_mtbf([{"attempts": [{"started": 0, "ended": 5, "category": "signal"}]}]) == 60.0
    assert estimate_mtbf([{"attempts": [{"started": 0, "ended": 500, "category": "done"}]}]) is None


# torchrun's report of its ranks' ends (hooks/sitecustomize.py writes it from ChildFailedError)
PEER = {
    "type": "RuntimeError",
    "message": "[pair.cc:537] Read error: Connection reset by peer",
    "traceback": "",
}


@pytest.mark.parametrize(
    ("failures", "own", "rank", "cause"),
    [
        # rank 1 SIGKILLed, rank 0 lost its peer and torchrun stopped it with SIGTERM: same second
        (
            [{"rank": 0, "pid": 10, "exitcode": -15, "signal": "SIGTERM", "time": 5},
             {"rank": 1, "pid": 11, "exitcode": -9, "signal": "SIGKILL", "time": 5}],
            {10: PEER}, 1, "rank 1 killed by SIGKILL",
        ),
        # rank 2 raised an error of its own; rank 0 lost its peer
        (
            [{"rank": 0, "pid": 10, "exitcode": 1, "signal": None, "time": 5},
             {"rank": 2, "pid": 12, "exitcode": 1, "signal": None, "time": 6}],
            {10: PEER, 12: err("ValueError", "bad batch")}, 2, "rank 2: ValueError: bad batch",
        ),
        # a rank that exited with a code and said nothing
        (
            [{"rank": 1, "pid": 11, "exitcode": 3, "signal": None, "time": 5}],
            {}, 1, "rank 1 exit code 3",
        ),
    ],
)  # fmt: skip
def test_the_rank_that_died_first_is_the_cause_not_its_peers(failures, own, rank, cause):
    from smartckpt_cli.supervise.policy import root_failure

    root = root_failure(failures, own)
    assert root is not None and root["rank"] == rank
    out = classify(AttemptEnd(1, True, root))
    assert out.action == "restart" and out.cause.startswith(cause), out
    assert "communication" not in out.cause and "peer" not in out.cause


def test_a_rank_killed_before_the_first_step_stops_the_run():
    from smartckpt_cli.supervise.policy import root_failure

    root = root_failure([{"rank": 1, "pid": 11, "exitcode": -9, "signal": "SIGKILL", "time": 1}], {})
    out = classify(AttemptEnd(1, False, root))
    assert out.action == "stop" and "rank 1 killed by SIGKILL" in out.cause


def test_hang_clock_runs_before_any_heartbeat_with_the_first_step_timeout():
    clock = HangClock(first_step=3.0)
    clock.start(100.0)
    assert clock.timeout() == 3.0 and not clock.hung(102.9) and clock.hung(103.1)
