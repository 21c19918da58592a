"""What smartckpt's monitoring costs a training step *when no step saves*: the signals, the
policy, the evaluation in the optimizer pre-hook, the boundary capture, the heartbeat. This is
not what checkpointing costs: that includes the saves (benchmarks/throughput.py measures it, with
the default policy and its saves); this is the part paid at every step whether or not anything is
saved, reported as the second line beside it.

An MLP (``--layers`` Linear layers of ``--width``, ReLU between, batch ``--batch``, AdamW, MSE to
random targets from a pool of 16 batches made on the device beforehand; or, with ``--model bench``,
``smartckpt bench``'s MLP of about ``--params`` parameters, batch 8) trains on ``--device``.
Blocks of steps alternate between training without smartckpt (A) and with it (B), A/B, B/A, A/B…
(the order flips every pair, so drift in the machine's speed hits both alike). The figure is the
per-step overhead of each pair, time per step B / A − 1: its median over the pairs and the
interquartile range. Timers read the clock after ``torch.cuda.synchronize`` at block ends only.

What runs, in one invocation (with neither ``--api`` nor ``--zero-code``: both, API first; the
JSON is written after each):

* **api** — one process per rank (``--ranks N``: N processes under ``torch.distributed.run``, gloo
  on CPU, NCCL on CUDA, each model in DistributedDataParallel). Two identical models, each with
  its own AdamW: model A trains plain; model B is registered with a ``CheckpointManager`` (default
  adaptive policy: its signals, evaluations, precursor check and, at several ranks, the decision
  collective) and the loop calls ``mgr.step(step, loss=loss)``.
* **zero-code** — one process per rank under ``smartckpt run`` (the supervisor polling beside it);
  the loop calls only ``smartckpt_cli.start_step()``, and the injected hooks find the model and
  optimizer and checkpoint them. For A blocks the hooks are detached (taken out of torch's global
  optimizer hooks, the ``backward`` wrapper undone), for B blocks put back: the same model trains
  in both. The supervisor's own CPU use (a poll a second) falls on both alike.

In both, ``min_interval`` = ``max_interval`` = 10⁹ s, so that no step saves: the figure is the
monitoring alone. The default policy's precursor alarm stays on (its evaluation in the optimizer
pre-hook and the boundary capture are part of the cost); since ``min_interval`` spaces precursor
saves from each other, at most one is taken in a run, and a pair whose B block saved (that one, or
memory pressure) is left out of the figures and counted (``pairs_dropped_for_a_save``).

Beside the A/B difference, ``inside`` is the time spent in smartckpt's own code, timed around
``mgr.step`` and around every hook it installs: the optimizer pre-hook (and, in zero-code mode, the
global optimizer hooks) and the signals' gradient hook on the reference parameter (armed around
evaluations). Not timed: the few lines of zero-code mode's ``backward`` wrapper.

Defaults of the model: 8 layers of 1024, batch 256 on CUDA (about 1.8 ms a step on an H200); 8
layers of 256, batch 64 on CPU (about 3 ms a step on 2 cores). ``--device`` defaults to cuda when
a GPU is present.

    python benchmarks/step_cost.py --device cpu
    python benchmarks/step_cost.py --device cpu --model bench --api --pairs 6 --min-block-steps 10 --json benchmarks/results/step_cost-bench.json
    python benchmarks/step_cost.py --device cpu --ranks 2 --json benchmarks/results/step_cost-2ranks.json
    python benchmarks/step_cost.py --device cuda --zero-code --json zc.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `python benchmarks/step_cost.py` from a checkout
    sys.path.insert(0, str(ROOT))

import _record  # noqa: E402
import torch  # noqa: E402

NO_SAVE = {"min_interval": 1e9, "max_interval": 1e9}
NO_SAVE_ENV = {f"SMARTCKPT_{k.upper()}": str(v) for k, v in NO_SAVE.items()}


# ---------------------------------------------------------------- the model and its step


def build(args: argparse.Namespace, device: torch.device) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    if args.model == "bench":
        from smartckpt_cli.bench.model import build_model

        return build_model(int(args.params), device=device)
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for i in range(args.layers):
        layers.append(torch.nn.Linear(args.width, args.width))
        if i < args.layers - 1:
            layers.append(torch.nn.ReLU())
    model = torch.nn.Sequential(*layers).to(device)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def batches(
    args: argparse.Namespace, device: torch.device, width: int, n: int = 16
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        x = torch.randn(args.batch, width, generator=g)
        y = torch.randn(args.batch, width, generator=g)
        out.append((x.to(device), y.to(device)))
    return out


def train_step(
    model: torch.nn.Module, opt: torch.optim.Optimizer, xy: tuple[torch.Tensor, torch.Tensor]
) -> torch.Tensor:
    x, y = xy
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _spread(pairs: list[tuple[float, float]]) -> list[float]:
    """Quartiles of the per-pair overhead with / without − 1."""
    ratios = sorted(w / a - 1.0 for a, w in pairs)
    return statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else [ratios[0]] * 3


def summary(
    pairs: list[tuple[float, float]], cpu: list[tuple[float, float]], inside: list[float], dropped: int
) -> dict[str, Any]:
    """``pairs``: (seconds per step without, with); ``cpu``: the same in the training thread's
    CPU time; ``inside``: seconds per step spent in smartckpt's own code (timed around
    ``mgr.step`` and the hooks: what it costs directly, less moved by other load on the machine
    than the A/B difference). Overhead per pair, its median and IQR."""
    q = _spread(pairs)
    qc = _spread(cpu)
    without = statistics.median(a for a, _ in pairs)
    with_ = statistics.median(w for _, w in pairs)
    return {
        "pairs": len(pairs),
        "pairs_dropped_for_a_save": dropped,
        "step_ms_without": without * 1e3,
        "step_ms_with": with_ * 1e3,
        "steps_per_s_without": 1.0 / without,
        "steps_per_s_with": 1.0 / with_,
        "overhead_median": q[1],
        "overhead_iqr": [q[0], q[2]],
        "thread_cpu_overhead_median": qc[1],
        "thread_cpu_overhead_iqr": [qc[0], qc[2]],
        "inside_us_per_step": statistics.median(inside) * 1e6,
        "inside_share": statistics.median(i / a for i, (a, _) in zip(inside, pairs, strict=True)),
        "per_pair": [
            {"without_ms": a * 1e3, "with_ms": w * 1e3, "cpu_without_ms": ca * 1e3, "cpu_with_ms": cw * 1e3}
            for (a, w), (ca, cw) in zip(pairs, cpu, strict=True)
        ],
    }


def _line(name: str, s: dict[str, Any]) -> str:
    return (
        f"{name}, no step saves: {s['step_ms_without']:.3f} ms/step without, {s['step_ms_with']:.3f} ms/step with "
        f"({s['steps_per_s_without']:.1f} vs {s['steps_per_s_with']:.1f} steps/s); overhead "
        f"{s['overhead_median']:+.2%} (IQR {s['overhead_iqr'][0]:+.2%} .. {s['overhead_iqr'][1]:+.2%}, "
        f"{s['pairs']} pairs); in the training thread's CPU time {s['thread_cpu_overhead_median']:+.2%} "
        f"(IQR {s['thread_cpu_overhead_iqr'][0]:+.2%} .. {s['thread_cpu_overhead_iqr'][1]:+.2%}); "
        f"inside smartckpt's code {s['inside_us_per_step']:.1f} µs/step = {s['inside_share']:.2%} of a step"
    )


# ---------------------------------------------------------------- inside the training process(es)


def _world(args: argparse.Namespace) -> tuple[torch.device, int, Any]:
    """The device of this rank, its rank, and torch.distributed when several ranks run."""
    device = torch.device(args.device)
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return device, 0, None
    import torch.distributed as dist

    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return device, dist.get_rank(), dist


def _ddp(
    model: torch.nn.Module, device: torch.device, dist: Any
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    if dist is not None:
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def _block_steps(
    args: argparse.Namespace, per_step: float, device: torch.device, dist: Any, rank: int
) -> int:
    """Steps in a block of about --block-seconds; every rank takes rank 0's number."""
    n = max(args.min_block_steps, int(args.block_seconds / per_step))
    if dist is not None:
        t = torch.tensor([n if rank == 0 else 0], device=device if device.type == "cuda" else "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        n = int(t.item())
    return n


def _alternate(
    args: argparse.Namespace, block: Any, n: int, rank: int, mode: str
) -> list[tuple[float, float, bool, float, float, float]]:
    """(seconds per step without, with, whether the B block saved, thread CPU seconds per step
    without, with, seconds per step inside smartckpt's code) for each pair."""
    pairs = []
    for i in range(args.pairs):
        order = (False, True) if i % 2 == 0 else (True, False)
        got = {w: block(w, n) for w in order}
        pairs.append((got[False][0], got[True][0], got[True][1], got[False][2], got[True][2], got[True][3]))
        if rank == 0:
            print(
                f"  {mode} pair {i + 1}/{args.pairs}: without {got[False][0] * 1e3:.3f} ms/step, "
                f"with {got[True][0] * 1e3:.3f} ms/step ({n} steps a block)"
                + (" — a save happened: left out" if got[True][1] else ""),
                flush=True,
            )
    return pairs


def api_worker(args: argparse.Namespace) -> None:
    import smartckpt_cli as sc

    device, rank, dist = _world(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    plain, plain_opt = _ddp(build(args, device)[0], device, dist)
    managed, managed_opt = _ddp(build(args, device)[0], device, dist)
    data = batches(args, device, _width(managed))
    mgr = sc.CheckpointManager(args.store, **NO_SAVE)
    mgr.register(model=managed, optimizer=managed_opt)
    inside = [0.0]
    table = managed_opt._optimizer_step_pre_hooks  # the manager's pre-hook, timed (benchmark only)
    for key, hook in list(table.items()):
        if getattr(hook, "__self__", None) is mgr:
            table[key] = _Timed(hook, inside)
    _time_grad_hook(mgr._signals, inside)
    step_no = 0

    def block(with_mgr: bool, n: int) -> tuple[float, bool, float, float]:
        nonlocal step_no
        model, opt = (managed, managed_opt) if with_mgr else (plain, plain_opt)
        saved = False
        inside[0] = 0.0
        sync(device)
        t0, c0 = time.perf_counter(), time.thread_time()
        for i in range(n):
            loss = train_step(model, opt, data[i % len(data)])
            if with_mgr:
                step_no += 1
                t1 = time.perf_counter()
                saved |= mgr.step(step_no, loss=loss).saved
                inside[0] += time.perf_counter() - t1
        sync(device)
        return (time.perf_counter() - t0) / n, saved, (time.thread_time() - c0) / n, inside[0] / n

    n = _warm_up(block)
    n = _block_steps(args, n, device, dist, rank)
    pairs = _alternate(args, block, n, rank, "api")
    every = mgr._signals.every  # the evaluation spacing the manager settled on (for the report)
    mgr.close()
    if rank == 0:
        Path(args.worker_out).write_text(json.dumps({"block_steps": n, "pairs": pairs, "eval_every": every}))
    if dist is not None:
        dist.destroy_process_group()


def _width(model: torch.nn.Module) -> int:
    return next(model.parameters()).shape[1]


def _warm_up(block: Any) -> float:
    """Warm up both (allocator, kernels, the manager's first evaluations and its measured
    cadence), three blocks each of up to 50 steps or about a second; the seconds per step."""
    per_step = max(block(False, 2)[0], block(True, 2)[0])
    n = max(3, min(50, int(1.0 / per_step)))
    for _ in range(3):
        block(False, n)
        block(True, n)
    return min(block(False, n)[0], block(True, n)[0])


def _time_grad_hook(signals: Any, inside: list[float]) -> None:
    """Time the signals' gradient hook (on one parameter, armed around evaluations) into
    ``inside``: registered through an attribute lookup, so the instance attribute is what the
    next arming registers; an armed hook is registered again (benchmark only)."""
    signals._after_backward = _Timed(signals._after_backward, inside)
    armed = signals._armed
    signals._hook(False)
    if armed:
        signals._hook(True)


class _Timed:
    """A hook that adds the time spent in it to ``inside`` (one list shared by all)."""

    def __init__(self, hook: Any, inside: list[float]) -> None:
        self.hook, self.inside = hook, inside
        self.__self__ = getattr(hook, "__self__", None)  # the hook's owner, as for the bound method

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return self.hook(*args, **kwargs)
        finally:
            self.inside[0] += time.perf_counter() - t0


class _Hooks:
    """Detach and re-attach what `smartckpt run` injected: the global optimizer step hooks, the
    backward wrapper, and the hooks its manager put on the optimizer and on one parameter
    (benchmark-only access to torch's hook tables: A blocks must run no smartckpt code at all).
    Attached, each hook is timed into ``inside[0]`` (the backward wrapper's own few lines are not)."""

    def __init__(self, opt: torch.optim.Optimizer, mgr: Any, inside: list[float]) -> None:
        from torch.optim import optimizer as optmod

        from smartckpt_cli.agent import runtime

        owners = (runtime._pre_hook, runtime._post_hook, mgr)
        tables: list[dict[int, Any]] = [
            optmod._global_optimizer_pre_hooks,
            optmod._global_optimizer_post_hooks,
            opt._optimizer_step_pre_hooks,
        ]
        self.ours = [
            (table, key, _Timed(hook, inside))
            for table in tables
            for key, hook in list(table.items())
            if hook in owners[:2] or getattr(hook, "__self__", None) is mgr
        ]
        # The signals' hook on one parameter is only on around evaluations: found when detaching.
        self.params = [p for g in opt.param_groups for p in g["params"]]
        self.signals = mgr._signals
        self.param_hooks: list[tuple[dict[int, Any], int, Any]] = []
        self.backward = (torch.Tensor.backward, torch.autograd.backward)
        self.attach()

    def detach(self) -> None:
        for table, key, _ in self.ours:
            table.pop(key, None)
        for p in self.params:
            table = p._post_accumulate_grad_hooks or {}
            for key, hook in list(table.items()):
                if getattr(hook, "__self__", None) is self.signals:
                    self.param_hooks.append((table, key, table.pop(key)))
        torch.Tensor.backward = getattr(self.backward[0], "__wrapped__", self.backward[0])  # type: ignore[method-assign]
        torch.autograd.backward = getattr(self.backward[1], "__wrapped__", self.backward[1])

    def attach(self) -> None:
        for table, key, timed in self.ours:
            table[key] = timed
        for table, key, hook in self.param_hooks:
            table[key] = hook
        self.param_hooks.clear()
        torch.Tensor.backward, torch.autograd.backward = self.backward  # type: ignore[method-assign]


def zero_code_worker(args: argparse.Namespace) -> None:
    import smartckpt_cli
    from smartckpt_cli.agent import runtime

    device, rank, dist = _world(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, opt = _ddp(build(args, device)[0], device, dist)
    data = batches(args, device, _width(model))
    smartckpt_cli.start_step()  # the one line zero-code mode asks of a loop
    zc = runtime._zc
    if zc is None:
        raise SystemExit("zero-code mode did not arm: run this under `smartckpt run`")
    inside = [0.0]
    hooks = _Hooks(opt, zc.mgr, inside)
    _time_grad_hook(zc.mgr._signals, inside)

    def block(with_zc: bool, n: int) -> tuple[float, bool, float, float]:
        (hooks.attach if with_zc else hooks.detach)()
        before = zc.mgr._stats.commits + len(zc.mgr._stats.skipped)
        inside[0] = 0.0
        sync(device)
        t0, c0 = time.perf_counter(), time.thread_time()
        for i in range(n):
            train_step(model, opt, data[i % len(data)])
        sync(device)
        seconds, cpu = (time.perf_counter() - t0) / n, (time.thread_time() - c0) / n
        zc.mgr.wait()  # a save that ran in this block is counted in it
        saved = zc.mgr._stats.commits + len(zc.mgr._stats.skipped) != before
        return seconds, saved, cpu, inside[0] / n

    n = _warm_up(block)
    n = _block_steps(args, n, device, dist, rank)
    pairs = _alternate(args, block, n, rank, "zero-code")
    hooks.attach()  # zero-code mode's final checkpoint at exit, as for a user
    if rank == 0:
        Path(args.worker_out).write_text(
            json.dumps({"block_steps": n, "pairs": pairs, "eval_every": zc.mgr._signals.every})
        )
    if dist is not None:
        dist.destroy_process_group()


# ---------------------------------------------------------------- the parent


def _worker_cmd(args: argparse.Namespace, worker: str, out: str, store: str) -> list[str]:
    cmd = [
        str(Path(__file__).resolve()), "--device", args.device, "--width", str(args.width),
        "--layers", str(args.layers), "--batch", str(args.batch), "--threads", str(args.threads),
        "--model", args.model, "--params", str(args.params),
        "--pairs", str(args.pairs), "--block-seconds", str(args.block_seconds),
        "--min-block-steps", str(args.min_block_steps),
        "--worker", worker, "--worker-out", out, "--store", store,
    ]  # fmt: skip
    if args.ranks > 1:
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            str(args.ranks),
            *cmd,
        ]
    return [sys.executable, *cmd]


def run_mode(args: argparse.Namespace, mode: str) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SMARTCKPT_")}
    with tempfile.TemporaryDirectory(prefix="smartckpt-step-cost-") as tmp:
        out, store = os.path.join(tmp, f"{mode}.json"), os.path.join(tmp, "store")
        cmd = _worker_cmd(args, mode, out, store)
        if mode == "zero-code":
            cmd = [sys.executable, "-m", "smartckpt_cli.cli.app", "run", "--dir", store, "--", *cmd]
            env.update(NO_SAVE_ENV)
        proc = subprocess.run(cmd, env=env)
        if proc.returncode != 0 or not os.path.exists(out):
            raise SystemExit(f"step_cost.py: the {mode} run failed (exit {proc.returncode})")
        got = json.loads(Path(out).read_text())
    kept = [p for p in got["pairs"] if not p[2]] or got["pairs"]
    res = summary(
        [(p[0], p[1]) for p in kept],
        [(p[3], p[4]) for p in kept],
        [p[5] for p in kept],
        len(got["pairs"]) - len(kept),
    )
    res["block_steps"] = got["block_steps"]
    res["eval_every_settled"] = got["eval_every"]
    return res


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cuda = torch.cuda.is_available()
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if cuda else "cpu")
    ap.add_argument("--ranks", type=int, default=1, help="processes under torch.distributed.run (DDP)")
    ap.add_argument("--api", action="store_true", help="only the API mode (mgr.step)")
    ap.add_argument("--zero-code", action="store_true", help="only zero-code mode under smartckpt run")
    ap.add_argument(
        "--model",
        choices=("mlp", "bench"),
        default="mlp",
        help="mlp: --layers x --width; bench: smartckpt bench's",
    )
    ap.add_argument("--params", type=float, default=1e8, help="--model bench: parameters")
    ap.add_argument("--width", type=int, default=None, help="default 1024 on CUDA, 256 on CPU")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=None, help="default 256 on CUDA, 64 on CPU")
    ap.add_argument(
        "--threads", type=int, default=0, help="torch CPU threads per process (0: torch's default)"
    )
    ap.add_argument("--pairs", type=int, default=10, help="A/B pairs of blocks per mode")
    ap.add_argument("--block-seconds", type=float, default=0.5, help="about how long one block lasts")
    ap.add_argument(
        "--min-block-steps",
        type=int,
        default=20,
        help="steps a block has at least (the evaluation spacing's multiple)",
    )
    _record.add_json_argument(ap, "step_cost")
    ap.add_argument("--worker", choices=("api", "zero-code"), help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    ap.add_argument("--store", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.device == "cuda" and not cuda:
        ap.error("--device cuda: no CUDA device is available")
    if args.width is None:
        args.width = 1024 if args.device == "cuda" else 256
    if args.batch is None:
        args.batch = 8 if args.model == "bench" else 256 if args.device == "cuda" else 64
    if min(args.ranks, args.layers, args.width, args.batch, args.pairs) < 1 or args.block_seconds <= 0:
        ap.error("--ranks, --layers, --width, --batch, --pairs and --block-seconds must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.worker == "api":
        api_worker(args)
        return 0
    if args.worker == "zero-code":
        zero_code_worker(args)
        return 0
    modes = [m for m, on in (("api", args.api), ("zero-code", args.zero_code)) if on] or ["api", "zero-code"]
    rec = _record.start("step_cost", torch.device(args.device))
    model = (
        {"bench": f"smartckpt bench's MLP of {args.params:.3g} parameters", "batch": args.batch}
        if args.model == "bench"
        else {"layers": args.layers, "width": args.width, "batch": args.batch}
    )
    rec.details.update(
        ranks=args.ranks,
        model=model | {"optimizer": "AdamW"},
        threads=args.threads or "torch default",
        modes=modes,
        what="monitoring cost: min_interval = max_interval = 1e9 s, no step saves",
    )
    desc = (
        f"smartckpt bench's MLP ({args.params:.3g} parameters)"
        if args.model == "bench"
        else f"MLP {args.layers}x{args.width}"
    )
    print(
        f"{desc}, batch {args.batch}, AdamW, {args.device}, {args.ranks} rank(s): " + ", ".join(modes),
        flush=True,
    )
    for mode in modes:
        key = mode.replace("-", "_")
        res = run_mode(args, mode)
        rec.details[key] = res
        label = "API (mgr.step)" if mode == "api" else "zero-code (smartckpt run)"
        print(_line(label, res), flush=True)
        what = f"{label}, no step saves"
        rec.add(
            f"{key}.overhead_pct",
            100 * res["overhead_median"],
            "%",
            f"{what}: time per step with / without - 1, median over pairs",
        )
        rec.add(
            f"{key}.overhead_q1_pct",
            100 * res["overhead_iqr"][0],
            "%",
            f"{what}: first quartile of the per-pair overhead",
        )
        rec.add(
            f"{key}.overhead_q3_pct",
            100 * res["overhead_iqr"][1],
            "%",
            f"{what}: third quartile of the per-pair overhead",
        )
        rec.add(
            f"{key}.inside_us",
            res["inside_us_per_step"],
            "us",
            f"{what}: time inside smartckpt's code per step (mgr.step and its hooks)",
        )
        rec.add(
            f"{key}.inside_pct", 100 * res["inside_share"], "%", f"{what}: the same, as a share of the step"
        )
        rec.add(
            f"{key}.step_ms_without",
            res["step_ms_without"],
            "ms",
            f"{what}: step without smartckpt (median block)",
        )
        rec.add(
            f"{key}.step_ms_with",
            res["step_ms_with"],
            "ms",
            f"{what}: step with smartckpt's monitoring (median block)",
        )
        rec.add(f"{key}.pairs", res["pairs"], "count", f"{what}: pairs of blocks in the figures")
        rec.add(
            f"{key}.eval_every",
            res["eval_every_settled"],
            "steps",
            f"{what}: steps between evaluations the manager settled on",
        )
        rec.write(args.json)  # after each mode: a run cut short keeps what it measured
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
