"""What one save costs the training loop, read from the loop's own clock: smartckpt against
``torch.distributed.checkpoint.async_save`` (DCP), each pair measured the same way.

Four ways of saving, in two pairs:

* copy overlapped with compute: the save is taken at the end of a step; the state is copied while
  the next forward and backward run, and the next optimizer update waits for what is left.
  smartckpt: ``mgr.step()`` taking the save (the lazy path, as in training). DCP: ``async_save``
  with ``DefaultStager(use_async_staging=True)`` (pinned memory on CUDA), its
  ``staging_completion`` waited for before the next optimizer update.
* copy inside the call: the state is copied before the call returns; only encoding and writing
  run in the background. smartckpt: ``mgr.save(step)``. DCP: ``async_save`` with no stager
  (staging into pageable memory inside the call).

smartckpt trains its own copy of the model (its manager's hooks are on its optimizer; a policy
that fires when the benchmark says, so both save at the same steps); DCP's two ways share a second
copy. A block is ``--before`` steps without a save, the save at the end of a step, the steps until
the save is written (smartckpt: committed; DCP: its upload future done), then ``--after`` steps.
Rounds rotate the order of the four (A B C D, B C D A, ...); the first round is a warm-up (each
way's first save: buffers allocated), reported apart.

Per save, from the loop's clock (benchmarks/_loop.py): the *loop wait* (t_k − m) + (t_k+1 − m),
the step that took the save and the next one, against m, the median of the steps before the save
in the same block (what the loop did just before it, so that drift between blocks does not
count); the *background* cost, what the steps after those lose until the save is written; and how
long it took to be written. Medians over the rounds after the first.

Where the checkpoints go (``--workdir``) does not change what the loop waits for (the copy), but
the time a save takes to be written sets how long a block lasts: on a disk that writes slowly, a
tmpfs (``--workdir /dev/shm``) keeps the blocks short enough for enough rounds.

    python benchmarks/loop_wait.py --model small
    python benchmarks/loop_wait.py --model bench --workdir /dev/shm --json benchmarks/results/loop_wait-bench.json
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _common as C
import _loop
import _record
import torch

import smartckpt_cli as sc

WAYS = ("smartckpt-lazy", "dcp-async-staged", "smartckpt-eager", "dcp-in-call")
LABEL = {
    "smartckpt-lazy": "smartckpt mgr.step() (lazy copy)",
    "dcp-async-staged": "DCP async_save, DefaultStager async staging",
    "smartckpt-eager": "smartckpt mgr.save() (eager copy)",
    "dcp-in-call": "DCP async_save, staging in the call",
}
OVERLAPPED = {
    "smartckpt-lazy": True,
    "dcp-async-staged": True,
    "smartckpt-eager": False,
    "dcp-in-call": False,
}


class FirePolicy:
    """Saves when ``fire`` is set: both tools save at the same steps of their blocks."""

    fire = False

    def should_save(self, ctx: Any) -> Any:
        from smartckpt_cli.trigger.context import Decision

        return Decision(self.fire, "benchmark")


class Way:
    """How one way of saving runs its block: ``save()`` at the end of a step, ``written()``."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.before_update: Any = None

    def save(self, step: int, loss: torch.Tensor) -> None: ...

    def written(self) -> bool:
        return True

    def wait(self) -> None: ...


class Smart(Way):
    def __init__(self, name: str, mgr: Any, policy: FirePolicy) -> None:
        super().__init__(name)
        self.mgr, self.policy, self.handle = mgr, policy, None

    def step_call(self, step: int, loss: torch.Tensor) -> None:
        self.mgr.step(step, loss=loss)  # every step, as in training (the policy stays quiet)

    def save(self, step: int, loss: torch.Tensor) -> None:
        if self.name == "smartckpt-lazy":
            self.policy.fire = True
            res = self.mgr.step(step, loss=loss)
            self.policy.fire = False
            self.handle = res.handle
        else:
            self.mgr.step(step, loss=loss)
            self.handle = self.mgr.save(step)
        if self.handle is None:
            raise RuntimeError(f"{self.name}: smartckpt did not save")

    def written(self) -> bool:
        return self.handle is None or self.handle.done()

    def wait(self) -> None:
        if self.handle is not None:
            self.handle.wait()
            if self.handle.error is not None:
                raise self.handle.error


class Dcp(Way):
    def __init__(self, name: str, model: torch.nn.Module, opt: Any, device: torch.device, root: Path) -> None:
        super().__init__(name)
        import torch.distributed.checkpoint as dcp

        self.dcp, self.model, self.opt, self.root = dcp, model, opt, root
        self.stager = None
        if name == "dcp-async-staged":
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            cuda = device.type == "cuda"
            self.stager = DefaultStager(
                StagingOptions(
                    use_pinned_memory=cuda,
                    use_shared_memory=False,
                    use_async_staging=True,
                    use_non_blocking_copy=cuda,
                )
            )
        self.response: Any = None
        self.staging: Any = None
        self.previous: Path | None = None
        self.path: Path | None = None
        self.n = 0

    def _wait_staged(self) -> None:
        if self.staging is not None:
            self.staging.result()
            self.staging = None

    def save(self, step: int, loss: torch.Tensor) -> None:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(self.model, self.opt)
        self.n += 1
        self.path = self.root / f"{self.name}-{self.n}"
        extra = {"async_stager": self.stager} if self.stager is not None else {}
        self.response = self.dcp.async_save(
            {"model": msd, "optimizer": osd}, checkpoint_id=str(self.path), **extra
        )
        self.staging = getattr(self.response, "staging_completion", None)
        self.before_update = self._wait_staged

    def _upload(self) -> Any:
        return getattr(self.response, "upload_completion", self.response)

    def written(self) -> bool:
        return self.response is None or (self.staging is None and self._upload().done())

    def wait(self) -> None:
        self._wait_staged()
        if self.response is not None:
            self._upload().result()
            self.response = None
        # The previous checkpoint goes once the new one is written (a careful user's rotation).
        if self.previous is not None:
            shutil.rmtree(self.previous, ignore_errors=True)
        self.previous = self.path

    def close(self) -> None:
        if self.stager is not None:
            self.stager.close()


def block(
    way: Way, net, opt, data, counter: list[int], args, device, smart: Smart | None
) -> tuple[list[float], int, int | None, float]:
    """(step times, index of the save step, index by which it was written, seconds to write)."""
    times: list[float] = []
    C.synchronize(device)
    last = time.perf_counter()
    saved_at, done_at, t_save, written_s = -1, None, 0.0, 0.0
    i = 0
    while True:
        hook = way.before_update if saved_at >= 0 and i == saved_at + 1 else None
        loss = data.step(net, opt, before_update=hook)
        counter[0] += 1
        if i == args.before:
            t_save = time.perf_counter()
            way.save(counter[0], loss)
            saved_at = i
        elif smart is not None:
            smart.step_call(counter[0], loss)
        C.synchronize(device)
        now = time.perf_counter()
        times.append(now - last)
        last = now
        if saved_at >= 0 and done_at is None and i > saved_at and way.written():
            done_at, written_s = i, now - t_save
        i += 1
        if done_at is not None and i > done_at + args.after:
            break
        if saved_at >= 0 and i > saved_at + args.max_steps:
            break  # not written within --max-steps: the rest of its cost is the drain
    way.wait()
    if done_at is None:
        written_s = time.perf_counter() - t_save
    return times, saved_at, done_at, written_s


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(_loop.MODELS), default="small")
    p.add_argument("--params", type=float, default=1e8, help="--model bench: parameters")
    p.add_argument("--batch", type=int, default=None, help="default: 64 (small), 8 (bench)")
    p.add_argument(
        "--rounds", type=int, default=None, help="rounds after the warm-up (default 10 small, 3 bench)"
    )
    p.add_argument(
        "--before", type=int, default=None, help="steps before each save (default 50 small, 4 bench)"
    )
    p.add_argument(
        "--after", type=int, default=None, help="steps after it is written (default 50 small, 3 bench)"
    )
    p.add_argument("--max-steps", type=int, default=100000, help="steps a save may take to be written")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--workdir", default=None, help="where checkpoints go (default: a temporary directory)")
    C.add_device_argument(p, "where the models train")
    _record.add_json_argument(p, "loop_wait")
    args = p.parse_args()
    device = C.device_of(args, p)
    small = args.model == "small"
    rounds = args.rounds or (10 if small else 5)
    args.before = args.before if args.before is not None else (50 if small else 6)
    args.after = args.after if args.after is not None else (50 if small else 2)
    if rounds < 1 or args.before < 2 or args.after < 0:
        p.error("--rounds must be at least 1, --before at least 2, --after not negative")
    batch = args.batch or _loop.MODELS[args.model]["batch"]
    if args.threads:
        torch.set_num_threads(args.threads)
    rec = _record.start("loop_wait", device)
    import warnings

    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    smart_net, smart_opt = _loop.build(args.model, args.params, device)
    plain_net, plain_opt = _loop.build(args.model, args.params, device)
    smart_data, plain_data = _loop.Data(smart_net, batch), _loop.Data(plain_net, batch)
    desc = _loop.describe(args.model, smart_net, batch)
    per: dict[str, list[tuple[list[float], list[_loop.SaveWindow]]]] = {w: [] for w in WAYS}
    written: dict[str, list[float]] = {w: [] for w in WAYS}
    counters = {"smart": [0], "plain": [0]}
    with tempfile.TemporaryDirectory(prefix="smartckpt-loop-wait-", dir=args.workdir) as tmp:
        root = Path(tmp)
        policy = FirePolicy()
        mgr = sc.CheckpointManager(root / "smartckpt", policy=policy, keep_last=2, preempt_signals="")
        mgr.register(model=smart_net, optimizer=smart_opt)
        mgr.restore()
        ways: dict[str, Way] = {
            "smartckpt-lazy": Smart("smartckpt-lazy", mgr, policy),
            "smartckpt-eager": Smart("smartckpt-eager", mgr, policy),
            "dcp-async-staged": Dcp("dcp-async-staged", plain_net, plain_opt, device, root),
            "dcp-in-call": Dcp("dcp-in-call", plain_net, plain_opt, device, root),
        }
        try:
            # Warm-up of both copies (allocator, kernels; smartckpt prepares its staging buffers).
            for _ in range(2 * args.before):
                smart_data.step(smart_net, smart_opt)
                plain_data.step(plain_net, plain_opt)
            for r in range(rounds + 1):
                order = WAYS[r % 4 :] + WAYS[: r % 4]
                for name in order:
                    way = ways[name]
                    smart_side = name.startswith("smartckpt")
                    net, opt, data = (
                        (smart_net, smart_opt, smart_data)
                        if smart_side
                        else (plain_net, plain_opt, plain_data)
                    )
                    times, k, done, secs = block(
                        way, net, opt, data, counters["smart" if smart_side else "plain"], args, device,
                        way if smart_side else None,  # type: ignore[arg-type]
                    )  # fmt: skip
                    per[name].append((times, [_loop.SaveWindow(k, done)]))
                    written[name].append(secs)
                print(
                    f"round {r + 1}/{rounds + 1}{' (warm-up)' if r == 0 else ''}: "
                    + ", ".join(f"{n} written in {written[n][-1]:.2f} s" for n in WAYS),
                    flush=True,
                )
        finally:
            for w in ways.values():
                if isinstance(w, Dcp):
                    w.close()
            failures = mgr.close()
    if failures:
        raise SystemExit(f"loop_wait.py: smartckpt saves failed: {failures}")
    summary: dict[str, Any] = {}
    for name in WAYS:
        costs = _loop.loop_costs(per[name], local=True)
        first, later = costs["saves"][0], costs["saves"][1:]
        waits = [s["loop_wait_s"] for s in later if s["loop_wait_s"] is not None]
        summary[name] = costs | {"written_s": written[name]}
        key = name.replace("-", "_")
        tag = f"{LABEL[name]} ({'copy overlapped with compute' if OVERLAPPED[name] else 'copy inside the call'})"
        rec.add(
            f"{key}.wait_ms",
            1e3 * statistics.median(waits),
            "ms",
            f"{tag}: loop wait per save, step-time difference, median",
        )
        rec.add(f"{key}.wait_min_ms", 1e3 * min(waits), "ms", f"{tag}: the same, smallest")
        rec.add(f"{key}.wait_max_ms", 1e3 * max(waits), "ms", f"{tag}: the same, largest")
        rec.add(
            f"{key}.background_ms",
            1e3 * statistics.median(s["background_s"] for s in later),
            "ms",
            f"{tag}: what later steps lost until it was written, median",
        )
        rec.add(
            f"{key}.written_s",
            statistics.median(written[name][1:]),
            "s",
            f"{tag}: from the save to written, median",
        )
        rec.add(
            f"{key}.ref_step_ms",
            1e3 * statistics.median(s["ref_step_s"] for s in later),
            "ms",
            f"{tag}: the steps before a save in its block (median over the saves)",
        )
        if first["loop_wait_s"] is not None:
            rec.add(
                f"{key}.first_wait_ms",
                1e3 * first["loop_wait_s"],
                "ms",
                f"{tag}: loop wait of the first save (warm-up round)",
            )
    for a, b in (("smartckpt_lazy", "dcp_async_staged"), ("smartckpt_eager", "dcp_in_call")):
        x, y = rec.figures[f"{a}.wait_ms"]["value"], rec.figures[f"{b}.wait_ms"]["value"]
        if y > 0:
            rec.add(
                f"{a}_over_{b}", x / y, "x", f"loop wait per save, {a} / {b} (the same way of overlapping)"
            )
    rec.add("rounds", rounds, "count", "rounds in the medians (after the warm-up round)")
    rec.add(
        "step_ms",
        rec.figures["dcp_in_call.ref_step_ms"]["value"],
        "ms",
        "a training step of the DCP copy before a save (median)",
    )
    rec.details.update(
        model=args.model,
        model_description=desc,
        params=sum(q.numel() for q in smart_net.parameters()),
        batch=batch,
        threads=torch.get_num_threads(),
        before=args.before,
        after=args.after,
        dcp_staging={n: LABEL[n] for n in WAYS},
        workdir=args.workdir,
        per_way={
            n: {k: v for k, v in s.items() if k != "clean_steps"} | {"clean_steps": s["clean_steps"]}
            for n, s in summary.items()
        },
    )
    rec.write(args.json)
    print(f"{desc}; loop wait per save (step-time difference, median of {rounds} rounds):")
    for name in WAYS:
        key = name.replace("-", "_")
        print(
            f"  {LABEL[name]:48s} {rec.figures[key + '.wait_ms']['value']:9.1f} ms; background "
            f"{rec.figures[key + '.background_ms']['value']:8.1f} ms; written in {rec.figures[key + '.written_s']['value']:.2f} s"
        )
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
