"""The simulation: calibrate, replay each policy, judge each divergence event."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from smartckpt_cli.errors import ConfigError
from smartckpt_cli.simulate.calibrate import _calibrate, _Knob, _knobs, _Run
from smartckpt_cli.simulate.onsets import Onset, detect_onsets, retained_before
from smartckpt_cli.simulate.replay import SimConfig, mean_lost_work, replay
from smartckpt_cli.simulate.results import OnsetResult, PolicyResult, SimResult
from smartckpt_cli.simulate.trace import POLICIES, Trace


def simulate(trace: Trace, cfg: SimConfig | None = None) -> SimResult:
    """Replay ``trace`` under every policy, calibrated to the same number of checkpoints."""
    cfg = cfg or SimConfig()
    cfg.check()
    rows = trace.rows
    if len(rows) < 2 or trace.duration <= 0:
        raise ConfigError(f"{trace.source}: a trace needs at least 2 rows spanning some time")
    start, end, duration = trace.start, trace.end, trace.duration
    knobs = _knobs(cfg, duration)

    def runner(name: str) -> Callable[[float], _Run]:
        def run(x: float) -> _Run:
            policy, mtbf = knobs[name].build(x)
            saves, stall = replay(rows, policy, cfg, mtbf=mtbf)
            return _Run(x, saves, stall, mean_lost_work(saves, start, end))

        return run

    chosen, target, method = _choose(cfg, knobs, runner)
    onsets = detect_onsets(
        rows,
        k=cfg.spike_k,
        window=cfg.spike_window,
        baseline=cfg.spike_baseline,
        noise=cfg.spike_noise,
        given=cfg.onsets,
    )
    results = [
        _policy_result(name, *chosen[name], knobs[name].label, onsets, cfg, start, duration)
        for name in POLICIES
    ]
    return SimResult(trace.source, len(rows), duration, cfg, target, method, tuple(onsets), tuple(results))


def _choose(
    cfg: SimConfig, knobs: dict[str, _Knob], runner: Callable[[str], Callable[[float], _Run]]
) -> tuple[dict[str, tuple[_Run, bool, bool]], int, str]:
    """(each policy's run, whether it was calibrated, whether to the exact count; the count;
    how it was chosen, in words): every policy at ``cfg.checkpoints``, else at the count
    adaptive takes as configured."""
    chosen: dict[str, tuple[_Run, bool, bool]] = {}  # name -> (run, calibrated, exact count)
    if cfg.checkpoints is None:
        ref = runner("adaptive")(knobs["adaptive"].default)
        chosen["adaptive"] = (ref, False, True)
        target = ref.n
        method = (
            f"adaptive as configured took {target} checkpoints; fixed and seed calibrated to "
            "that count (each at its least-lost-work setting giving it)"
        )
    else:
        target = cfg.checkpoints
        method = (
            f"every policy calibrated to {target} checkpoints (fixed and seed at their "
            "least-lost-work setting giving it, adaptive at the middle of its range)"
        )
    for name in POLICIES:
        if name in chosen:
            continue
        run, exact = _calibrate(knobs[name], runner(name), target, best=name != "adaptive")
        chosen[name] = (run, True, exact)
    return chosen, target, method


def _policy_result(
    name: str,
    run: _Run,
    calibrated: bool,
    exact: bool,
    label: Callable[[float], str],
    onsets: list[Onset],
    cfg: SimConfig,
    start: float,
    duration: float,
) -> PolicyResult:
    """One policy's figures, and for each onset the checkpoint a rollback would go back to."""
    per = []
    for o in onsets:
        if cfg.rollback == "onset":
            o = replace(o, end_index=o.index, end_step=o.step, end_time=o.time)
        ck = retained_before(run.saves, o, cfg.keep_last)
        t = ck.time if ck is not None else start
        per.append(OnsetResult(o.step, ck.step if ck else None, o.time - t, o.end_time - t))
    return PolicyResult(
        name,
        label(run.x),
        calibrated,
        exact,
        run.n,
        (run.n * cfg.save_cost + run.stall) / duration,
        run.lost,
        run.lost * duration / cfg.mtbf,
        tuple(per),
        tuple(run.saves),
    )
