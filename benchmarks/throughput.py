"""What checkpointing costs training, as the user sees it: steps per second with smartckpt's
default policy *and the saves it takes*, against no checkpointing, in interleaved blocks; and
what each save costs the loop, as a step-time difference read from the loop's own clock.

The model (``--model``):

* ``small``: an MLP of 8 Linear(256) layers with ReLU, batch 64, AdamW: about 3 ms a step on two
  CPU cores (benchmarks/step_cost.py's CPU model);
* ``bench``: ``smartckpt bench``'s model, an MLP of about ``--params`` (1e8) parameters, batch 8
  on CPU, AdamW: 1.2 GB of state, about 0.7 s a step on two CPU cores.

It trains two ways in turn: A with no checkpointing, B under a ``CheckpointManager`` with the
default settings: the adaptive policy saves first at ``max_interval`` / 2 (90 s) after the manager starts,
then every Young/Daly interval of its measured save cost (never closer than ``min_interval``, 10 s;
sooner when its signals alarm); the loop calls ``mgr.step(step, loss=loss)`` at every step.

**Cycles.** A and B take turns, in chunks of ``--chunk`` seconds (B) and ``--a-share`` of that
(A), so that the machine's drift hits both alike. It is one model: in A chunks the manager's hooks
are switched off and ``mgr.step`` is not called (benchmark-only access to its hook handles), so A
and B share the model's memory, caches and batches. Each cycle is one period of the policy:

1. the step at which the policy saves (the cycle's first B step);
2. B alone until that save has committed (none of its background work falls into an A chunk);
3. A and B chunks in turn, until B has trained, since the save, as long as the policy waited
   before it asked for the next save. That next save is put off (``Deferring``: the policy is
   asked again at the next B step and, still due, saves then, starting the next cycle), since
   the policy's clock, on the wall, also ran while A trained.

So, in B's own time, the saves come when the policy decides, as in an uninterrupted run. (When the
policy asked at the first B step after an A chunk, the wait is counted from that chunk's start: the
earliest it may have been due, so a save is, if anything, counted as coming a little early.) Before
the first cycle, A and B chunks alternate with every save put off until the policy asks for its
first (90 s after the manager started): the no-save figure of the same run (less the steps from a
precursor save to its commit, if the policy took one meanwhile). The first cycle, a
fresh manager's first save, is reported apart. Per cycle: B's steps per second over A's; the
figure is the median over the cycles after the first (quartiles and range in the file). Saves the
policy takes before an optimizer update (a precursor alarm) are never put off: they count in
their cycle.

**The loop's clock.** Every B iteration is timed whole (forward, backward, the optimizer step with
smartckpt's pre-hook, ``mgr.step``). For a save
taken by ``mgr.step`` of step k: its *loop wait* is (t_k − m) + (t_k+1 − m), the step that took
the save and the next one, whose optimizer update waits for the lazy copies, with m the median B
step of the same cycle outside any save's window (benchmarks/_loop.py); what the steps after those
lose while the save is encoded and written in the background, until it commits, is reported beside
it. The library's own counter
(``SaveHandle.loop_wait_seconds``) is recorded too, for comparison.

    python benchmarks/throughput.py --model small --json benchmarks/results/throughput-small.json
    python benchmarks/throughput.py --model bench --cycles 2 --json benchmarks/results/throughput-bench.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import _common as C
import _loop
import _record
import torch

import smartckpt_cli as sc


class Deferring:
    """The manager's policy, unchanged, except that a save it asks for while ``hold`` is set is
    put off (``due`` is set; the policy is asked again at the next step and, still due, saves
    then). The benchmark holds from the block's save on, so a B block ends at the step where
    the policy wants the next save, and the next B block starts with it: the policy's clock is
    paused during the A block in between. Saves before the optimizer update (a precursor alarm)
    are never put off."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.hold, self.due = inner, False, False

    def should_save(self, ctx: Any) -> Any:
        from smartckpt_cli.trigger.context import Decision

        decision = self.inner.should_save(ctx)
        if decision.save and self.hold:
            self.due = True
            return Decision(False, score=decision.score, calm=decision.calm)
        return decision

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@dataclass
class Save:
    index: int  # position of the step that took it, in the cycle's list of B steps
    handle: Any
    reason: str
    library_wait: float = 0.0  # SaveHandle.loop_wait_seconds
    done_at: int | None = None  # index of the B step after which it was seen committed


@dataclass
class Cycle:
    number: int
    b_steps: list[float] = field(default_factory=list)  # seconds of each B iteration
    a_steps: int = 0
    a_seconds: float = 0.0
    saves: list[Save] = field(default_factory=list)
    due_after: float | None = None  # wall seconds from the save until the policy asked again

    @property
    def b_seconds(self) -> float:
        return sum(self.b_steps)


class Loop:
    """One model, trained two ways in turn, chunk by chunk (module docstring): B with smartckpt
    (the manager's hooks on, ``mgr.step`` at every step), A without (its hooks off, no
    ``mgr.step``). One model, so that A and B share its memory, caches and batches and no chunk
    pays for bringing the other copy back into the caches."""

    def __init__(self, mgr: Any, policy: Deferring, net: Any, opt: Any, data: Any, device: Any) -> None:
        self.mgr, self.policy, self.net, self.opt, self.data, self.device = (
            mgr,
            policy,
            net,
            opt,
            data,
            device,
        )
        self.step_no = 0
        self.on = True
        # Benchmark-only: the manager's optimizer pre-hook and the signals' gradient hook run in B
        # chunks only. The pre-hook is put back behind a switch (close() removes it as its own);
        # the gradient hook is registered through an attribute lookup, so the instance attribute
        # is what the next arming registers (an armed one is registered again).
        for handle in mgr._hooks:
            handle.remove()
        mgr._hooks = [opt.register_step_pre_hook(self._pre_hook)]
        signals = mgr._signals
        grad_hook = signals._after_backward
        signals._after_backward = lambda p: grad_hook(p) if self.on else None
        armed = signals._armed
        signals._hook(False)
        if armed:
            signals._hook(True)

    def _pre_hook(self, *args: Any) -> None:
        if self.on:
            self.mgr._before_optimizer_step(*args)

    def a_chunk(self, cyc: Cycle, seconds: float) -> None:
        self.on = False
        C.synchronize(self.device)
        t0 = time.perf_counter()
        while True:
            self.data.step(self.net, self.opt)
            cyc.a_steps += 1
            if time.perf_counter() - t0 >= seconds:
                break
        C.synchronize(self.device)
        cyc.a_seconds += time.perf_counter() - t0
        self.on = True

    def b_step(self, cyc: Cycle) -> Any:
        t0 = time.perf_counter()
        loss = self.data.step(self.net, self.opt)
        self.step_no += 1
        res = self.mgr.step(self.step_no, loss=loss)
        C.synchronize(self.device)  # the loop's clock includes the device's queued work (CUDA)
        cyc.b_steps.append(time.perf_counter() - t0)
        return res


def warm_up(loop: Loop, chunk: float, a_share: float, limit: float) -> Cycle:
    """A and B chunks in turn, no save (the policy's first is put off; a precursor save is not: its
    steps until it commits are left out of the no-save figure), until the policy asks for its
    first save (90 s after the manager started, by default)."""
    cyc = Cycle(0)
    loop.policy.hold, loop.policy.due = True, False
    started = time.perf_counter()
    while not loop.policy.due:
        t0 = time.perf_counter()
        while not loop.policy.due and time.perf_counter() - t0 < chunk:
            res = loop.b_step(cyc)
            if res.saved and res.handle is not None:
                # A save the policy takes before an update (a precursor alarm) is never put off:
                # B trains alone until it commits, and the warm-up no longer counts as no-save.
                save = Save(len(cyc.b_steps) - 1, res.handle, res.reason)
                cyc.saves.append(save)
                while not res.handle.done():
                    loop.b_step(cyc)
                save.done_at = len(cyc.b_steps) - 1
        loop.a_chunk(cyc, chunk * a_share)
        if time.perf_counter() - started > limit:
            raise SystemExit(f"throughput.py: the policy asked for no save within {limit:.0f} s")
    return cyc


def run_cycle(loop: Loop, n: int, chunk: float, a_share: float, limit: float) -> Cycle:
    """One cycle of the policy (module docstring): its save, B alone until the save committed,
    then A and B chunks in turn until B has trained as long after the save as the policy waited
    before asking for the next one."""
    cyc = Cycle(n)
    policy = loop.policy
    policy.hold, policy.due = False, False
    pending: list[Save] = []
    t_save: float | None = None
    first_of_chunk = -1
    last_b_end = time.perf_counter()  # before an A chunk: the earliest the policy may have been due
    after_a = False
    started = time.perf_counter()
    while True:
        chunk_start = time.perf_counter()
        while True:  # a B chunk
            res = loop.b_step(cyc)
            now = time.perf_counter()
            if res.saved and res.handle is not None:
                save = Save(len(cyc.b_steps) - 1, res.handle, res.reason)
                cyc.saves.append(save)
                pending.append(save)
                if t_save is None:
                    t_save, policy.hold = now, True
            for save in [s for s in pending if s.handle.done()]:
                save.done_at = len(cyc.b_steps) - 1
                pending.remove(save)
            if policy.due and cyc.due_after is None and t_save is not None:
                # Conservative: when the answer came at the first step after an A chunk, the
                # policy may have been due as early as that chunk's start.
                asked = (
                    last_b_end
                    if after_a and len(cyc.b_steps) - 1 == first_of_chunk
                    else now - cyc.b_steps[-1]
                )
                cyc.due_after = max(0.0, asked - t_save)
            after_a = False
            if pending or t_save is None:
                if time.perf_counter() - started > limit:
                    raise SystemExit(f"throughput.py: no save within {limit:.0f} s; nothing measured")
                continue  # B alone until its save is taken and committed
            if (
                cyc.due_after is not None
                and cyc.b_seconds - sum(cyc.b_steps[: cyc.saves[0].index + 1]) >= cyc.due_after
            ):
                for save in cyc.saves:
                    if save.handle.error is not None:
                        raise save.handle.error
                    save.library_wait = save.handle.loop_wait_seconds
                return cyc
            if now - chunk_start >= chunk:
                break
        last_b_end = time.perf_counter()
        loop.a_chunk(cyc, chunk * a_share)
        after_a = True
        first_of_chunk = len(cyc.b_steps)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(_loop.MODELS), default="small")
    p.add_argument("--params", type=float, default=1e8, help="--model bench: parameters")
    p.add_argument("--batch", type=int, default=None, help="default: 64 (small), 8 (bench)")
    p.add_argument("--cycles", type=int, default=4, help="cycles of the policy after the first")
    p.add_argument(
        "--chunk", type=float, default=None, help="seconds of a B chunk (default 2 small, 8 bench)"
    )
    p.add_argument("--a-share", type=float, default=1.0, help="an A chunk lasts this share of a B chunk")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--workdir", default=None, help="where the store goes (default: a temporary directory)")
    C.add_device_argument(p, "where the models train")
    _record.add_json_argument(p, "throughput")
    args = p.parse_args()
    device = C.device_of(args, p)
    chunk = args.chunk or (2.0 if args.model == "small" else 8.0)
    if args.cycles < 1 or args.a_share <= 0 or chunk <= 0:
        p.error("--cycles must be at least 1, --chunk and --a-share positive")
    batch = args.batch or _loop.MODELS[args.model]["batch"]
    if args.threads:
        torch.set_num_threads(args.threads)
    rec = _record.start("throughput", device)
    net, opt = _loop.build(args.model, args.params, device)
    desc = _loop.describe(args.model, net, batch)
    started = time.monotonic()
    print(desc, flush=True)
    with tempfile.TemporaryDirectory(prefix="smartckpt-throughput-", dir=args.workdir) as tmp:
        mgr = sc.CheckpointManager(tmp)  # the defaults: adaptive policy, keep_last 3
        policy = Deferring(mgr.policy)
        mgr.policy = policy
        mgr.register(model=net, optimizer=opt)
        mgr.restore()
        loop = Loop(mgr, policy, net, opt, _loop.Data(net, batch), device)
        warm = warm_up(loop, chunk, args.a_share, limit=900.0)
        print(
            f"before the first save: {len(warm.b_steps) / warm.b_seconds:.2f} steps/s with smartckpt (no save), "
            f"{warm.a_steps / warm.a_seconds:.2f} without",
            flush=True,
        )
        cycles = []
        for n in range(1, args.cycles + 2):
            cyc = run_cycle(loop, n, chunk, args.a_share, limit=900.0)
            cycles.append(cyc)
            print(
                f"cycle {n}: B {len(cyc.b_steps)} steps in {cyc.b_seconds:.1f} s "
                f"({len(cyc.b_steps) / cyc.b_seconds:.2f} steps/s), A {cyc.a_steps / cyc.a_seconds:.2f} steps/s; "
                f"save(s) at B step {[s.index for s in cyc.saves]} [{', '.join(s.reason for s in cyc.saves)}], "
                f"next asked for {cyc.due_after:.1f} s after",
                flush=True,
            )
        failures = mgr.close()
    if failures:
        raise SystemExit(f"throughput.py: background saves failed: {failures}")
    ratios = [(len(c.b_steps) / c.b_seconds) / (c.a_steps / c.a_seconds) for c in cycles]
    steady = ratios[1:]
    q = statistics.quantiles(steady, n=4, method="inclusive") if len(steady) > 1 else [steady[0]] * 3
    # Each cycle against its own steps outside the save's window: the machine's speed drifts from
    # one cycle (minutes) to the next, less within one.
    per_cycle = [
        _loop.loop_costs([(c.b_steps, [_loop.SaveWindow(s.index, s.done_at) for s in c.saves])])
        for c in cycles
    ]
    saves = [
        cost | {"cycle": c.number, "reason": s.reason, "library_loop_wait_s": s.library_wait}
        for c, costs in zip(cycles, per_cycle, strict=True)
        for cost, s in zip(costs["saves"], c.saves, strict=True)
    ]
    first = saves[0]
    later = [x for x in saves if x["cycle"] > 1 and x["loop_wait_s"] is not None]
    ratio = statistics.median(steady)
    a_sps = [c.a_steps / c.a_seconds for c in cycles]
    b_sps = [len(c.b_steps) / c.b_seconds for c in cycles]
    rec.add(
        "ratio", ratio, "x", "steps/s with the default policy and its saves / without, median over cycles"
    )
    rec.add("ratio_q1", q[0], "x", "first quartile of those ratios")
    rec.add("ratio_q3", q[2], "x", "third quartile of those ratios")
    rec.add("ratio_min", min(steady), "x", "smallest of those ratios")
    rec.add("ratio_max", max(steady), "x", "largest of those ratios")
    rec.add("ratio_first_cycle", ratios[0], "x", "the same for the cycle of the first save (a fresh manager)")
    # Monitoring only: the B steps before the first save, less the window of a precursor save the
    # policy took meanwhile (the steps from it until it committed).
    window = {i for s in warm.saves for i in range(s.index, (s.done_at or s.index) + 1)}
    quiet = [t for i, t in enumerate(warm.b_steps) if i not in window]
    rec.add(
        "ratio_no_save",
        (len(quiet) / sum(quiet)) / (warm.a_steps / warm.a_seconds),
        "x",
        "before the first save (monitoring only), the same chunks"
        + (", less the window of a precursor save" if warm.saves else ""),
    )
    rec.add(
        "cost_pct", 100.0 * (1.0 - ratio), "%", "throughput lost to checkpointing, saves included (1 - ratio)"
    )
    rec.add(
        "steps_per_s_without", statistics.median(a_sps), "steps/s", "no checkpointing, median over cycles"
    )
    rec.add(
        "steps_per_s_with",
        statistics.median(b_sps[1:]),
        "steps/s",
        "smartckpt, median over cycles after the first",
    )
    rec.add(
        "step_ms",
        1e3 / statistics.median(a_sps),
        "ms",
        "training step without checkpointing (1 / median steps/s)",
    )
    rec.add(
        "interval_s",
        statistics.median(c.due_after for c in cycles[1:]),
        "s",
        "seconds from one save of the default policy until it asked for the next (median)",
    )
    rec.add("cycles", len(steady), "count", "cycles in the median (after the first)")
    rec.add("saves", len(saves), "count", "saves the policy took in the cycles")
    rec.add(
        "ref_step_ms",
        1e3 * statistics.median(c["ref_step_s"] for c in per_cycle),
        "ms",
        "a B step outside any save's window (median over the cycles of each cycle's median)",
    )
    if first["loop_wait_s"] is not None:
        rec.add(
            "first_wait_ms",
            1e3 * first["loop_wait_s"],
            "ms",
            "loop wait of the first save, step-time difference",
        )
        rec.add(
            "first_library_wait_ms",
            1e3 * first["library_loop_wait_s"],
            "ms",
            "the same save, SaveHandle.loop_wait_seconds",
        )
        rec.add(
            "first_background_ms",
            1e3 * first["background_s"],
            "ms",
            "first save: what the later steps lost until it committed",
        )
    if later:
        rec.add(
            "later_wait_ms",
            1e3 * statistics.median(x["loop_wait_s"] for x in later),
            "ms",
            "loop wait of later saves, step-time difference, median",
        )
        rec.add(
            "later_library_wait_ms",
            1e3 * statistics.median(x["library_loop_wait_s"] for x in later),
            "ms",
            "later saves, SaveHandle.loop_wait_seconds, median",
        )
        rec.add(
            "later_background_ms",
            1e3 * statistics.median(x["background_s"] for x in later),
            "ms",
            "later saves: what the later steps lost until each committed, median",
        )
        rec.add("later_saves", len(later), "count", "later saves measured")
    rec.details.update(
        model=args.model,
        model_description=desc,
        params=sum(q.numel() for q in net.parameters()),
        batch=batch,
        policy="the defaults (adaptive)",
        threads=torch.get_num_threads(),
        chunk_s=chunk,
        a_share=args.a_share,
        warm_up={
            "b_steps": len(warm.b_steps),
            "b_s": warm.b_seconds,
            "a_steps": warm.a_steps,
            "a_s": warm.a_seconds,
            "saves": [s.reason for s in warm.saves],
        },
        ratios=ratios,
        cycles=[
            {
                "b_steps": len(c.b_steps),
                "b_s": c.b_seconds,
                "a_steps": c.a_steps,
                "a_s": c.a_seconds,
                "due_after_s": c.due_after,
                "b_step_s": c.b_steps,
            }
            for c in cycles
        ],
        saves=saves,
        elapsed_s=time.monotonic() - started,
    )
    rec.write(args.json)
    print(
        f"{desc}: {statistics.median(a_sps):.2f} steps/s without, {statistics.median(b_sps[1:]):.2f} with: "
        f"{ratio:.4f}x (IQR {q[0]:.4f} .. {q[2]:.4f}, {len(steady)} cycles, a save every "
        f"{rec.figures['interval_s']['value']:.1f} s); loop wait per save, step-time difference: first "
        + (f"{1e3 * first['loop_wait_s']:.1f} ms" if first["loop_wait_s"] is not None else "-")
        + (f", later {rec.figures['later_wait_ms']['value']:.1f} ms (median)" if later else "")
        + f"\nwrote {args.json}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
