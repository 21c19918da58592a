"""Every optimizer in ``torch.optim`` and every LR scheduler in ``torch.optim.lr_scheduler``, plus
GradScaler, round-trips bit for bit: 3 steps, save, restore into freshly built objects, 3 more
steps, equal to an uninterrupted run (weights, optimizer state, scheduler state, losses).

The classes are discovered from the installed torch when the test runs, so one that a later torch
adds is covered without editing this file; a class whose constructor needs an argument this file
cannot guess fails with that argument's name.
"""

from __future__ import annotations

import copy
import inspect
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

import smartckpt_cli as sc
from smartckpt_cli.errors import StateMismatchError

STEPS = 3  # before the save, and again after the restore


def _discover(module: Any, base: type, exclude: tuple[type, ...] = ()) -> list[type]:
    return sorted(
        (
            c
            for c in vars(module).values()
            if inspect.isclass(c)
            and issubclass(c, base)
            and c is not base
            and c not in exclude
            and not c.__name__.startswith("_")
            and c.__module__.startswith(module.__name__)
        ),
        key=lambda c: c.__name__,
    )


OPTIMIZERS = _discover(torch.optim, torch.optim.Optimizer)
SCHEDULERS = _discover(torch.optim.lr_scheduler, torch.optim.lr_scheduler.LRScheduler) + [
    c
    for c in [getattr(torch.optim.lr_scheduler, "ReduceLROnPlateau", None)]
    if c is not None and not issubclass(c, torch.optim.lr_scheduler.LRScheduler)
]


# ---------------------------------------------------------------- the training problem


class _Dense(torch.nn.Module):
    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.a = torch.nn.Linear(6, 8, bias=bias)
        self.b = torch.nn.Linear(8, 3, bias=bias)

    def forward(self, step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(1000 + step)
        dev = self.a.weight.device
        x = torch.randn(16, 6, generator=g).to(dev)
        y = torch.randn(16, 3, generator=g).to(dev)
        return (self.b(torch.tanh(self.a(x))) - y).pow(2).mean()

    def groups(self) -> list[list[torch.nn.Parameter]]:
        return [list(self.a.parameters()), list(self.b.parameters())]


class _Sparse(torch.nn.Module):
    """Embeddings with sparse gradients, for SparseAdam."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Embedding(20, 4, sparse=True)
        self.b = torch.nn.Embedding(20, 4, sparse=True)

    def forward(self, step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(1000 + step)
        idx = torch.randint(0, 20, (8,), generator=g).to(self.a.weight.device)
        return (self.a(idx) * self.b(idx)).sum(1).sub(1.0).pow(2).mean()

    def groups(self) -> list[list[torch.nn.Parameter]]:
        return [[self.a.weight], [self.b.weight]]


def _model(opt_cls: type, seed: int, device: str = "cpu") -> torch.nn.Module:
    torch.manual_seed(seed)
    if opt_cls.__name__ == "SparseAdam":
        return _Sparse().to(device)
    # Muon orthogonalises 2-D matrices only: no biases for it.
    return _Dense(bias=opt_cls.__name__ != "Muon").to(device)


def _optimizer(opt_cls: type, model: Any) -> torch.optim.Optimizer:
    """Two parameter groups (the second with its own learning rate) where the optimizer allows
    them; LBFGS refuses several groups and gets one."""
    kwargs: dict[str, Any] = {"lr": 0.5} if opt_cls.__name__ == "LBFGS" else {}
    if opt_cls.__name__ == "LBFGS":
        kwargs["history_size"] = 4
    first, second = model.groups()
    lr = inspect.signature(opt_cls).parameters.get("lr")
    base = lr.default if lr is not None and isinstance(lr.default, float) else 1e-2
    try:
        return opt_cls([{"params": first}, {"params": second, "lr": base * 0.5}], **kwargs)
    except ValueError:
        return opt_cls(first + second, **kwargs)


def _train_step(model: Any, opt: torch.optim.Optimizer, step: int, scaler: Any = None) -> float:
    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = model(step)
        (scaler.scale(loss) if scaler is not None else loss).backward()
        return loss

    if isinstance(opt, torch.optim.LBFGS):
        return float(opt.step(closure).detach())
    loss = closure()
    if scaler is not None:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()
    return float(loss.detach())


# ---------------------------------------------------------------- schedulers


def _scheduler(cls: type, opt: torch.optim.Optimizer) -> Any:
    """Build ``cls`` on ``opt`` from its signature: known argument names get small values that
    make the learning rate move within 6 steps."""
    known: dict[str, Any] = {
        "lr_lambda": lambda epoch: 0.9**epoch,
        "step_size": 2,
        "milestones": [2, 4],
        "gamma": 0.8,
        "factor": 0.5,
        "total_iters": 4,
        "start_factor": 0.5,
        "power": 2.0,
        "T_max": 6,
        "T_0": 2,
        "base_lr": 1e-3,
        "max_lr": 1e-2,
        "step_size_up": 2,
        "total_steps": 10,
        "patience": 0,
    }
    if cls.__name__ == "MultiplicativeLR":
        known["lr_lambda"] = lambda epoch: 0.95
    if cls.__name__ == "CyclicLR":
        known["cycle_momentum"] = False  # AdamW has betas, not momentum
    kwargs: dict[str, Any] = {}
    for name, p in inspect.signature(cls).parameters.items():
        if name in ("self", "optimizer") or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if name == "schedulers":
            kwargs[name] = [
                torch.optim.lr_scheduler.ConstantLR(opt, factor=0.5, total_iters=2),
                torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.8),
            ]
        elif name in known:
            kwargs[name] = known[name]
        elif p.default is inspect.Parameter.empty:
            raise AssertionError(f"{cls.__name__}: no value for its required argument {name!r}")
    if "optimizer" in inspect.signature(cls).parameters:
        if cls.__name__ == "SequentialLR":
            kwargs["milestones"] = [2]
        return cls(opt, **kwargs) if cls.__name__ != "ChainedScheduler" else cls(optimizer=opt, **kwargs)
    return cls(**kwargs)


def _sched_step(sched: Any, loss: float) -> None:
    if isinstance(sched, torch.optim.lr_scheduler.ReduceLROnPlateau):
        sched.step(loss)
    else:
        sched.step()


# ---------------------------------------------------------------- comparison


def _differences(a: Any, b: Any, path: str) -> list[str]:
    """Where nested state ``a`` is not bitwise ``b`` (tensors by bytes, dtype and shape; floats by
    value or both NaN), one line per place; empty when equal."""
    if isinstance(b, torch.Tensor):
        if not isinstance(a, torch.Tensor):
            return [f"{path}: not a tensor"]
        if a.dtype != b.dtype or a.shape != b.shape:
            return [f"{path}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"]
        if b.is_sparse:
            a, b = a.to_dense(), b.to_dense()
        same = torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
        return [] if same else [f"{path}: bytes differ"]
    if isinstance(b, dict):
        if not isinstance(a, dict) or set(a) != set(b):
            keys = sorted(map(str, a)) if isinstance(a, dict) else type(a).__name__
            return [f"{path}: keys {keys} vs {sorted(map(str, b))}"]
        return [d for k in b for d in _differences(a[k], b[k], f"{path}/{k}")]
    if isinstance(b, list | tuple):
        if not isinstance(a, list | tuple) or len(a) != len(b):
            return [f"{path}: length differs"]
        return [
            d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in _differences(x, y, f"{path}/{i}")
        ]
    if isinstance(b, float) and math.isnan(b):
        return [] if isinstance(a, float) and math.isnan(a) else [f"{path}: {a!r} vs nan"]
    return [] if a == b else [f"{path}: {a!r} vs {b!r}"]


def _states(objs: dict[str, Any]) -> dict[str, Any]:
    return {name: copy.deepcopy(o.state_dict()) for name, o in objs.items()}


@dataclass
class _Resumed:
    """What ``_run`` saw: the reference run's losses and final state, and the resumed run's."""

    restored_step: int | None
    ref_losses: list[float]
    losses: list[float]
    ref_state: dict[str, Any]
    state: dict[str, Any]
    changed_by_restore: list[str]  # where the fresh objects' state differed before the restore
    fresh: dict[str, Any]


def _run(
    tmp_path: Any,
    build: Callable[[int], dict[str, Any]],
    step_fn: Callable[[dict[str, Any], int], float],
) -> _Resumed:
    """The reference run (6 steps, no smartckpt) against: 3 steps under a manager, a save,
    fresh objects (another seed) restored by a new manager, 3 more steps."""
    ref = build(0)
    ref_losses = [step_fn(ref, s) for s in range(2 * STEPS)]

    run = build(0)
    losses = []
    with sc.CheckpointManager(tmp_path, eval_every=1, max_interval=3600, min_interval=0) as mgr:
        mgr.register(**run)
        for s in range(STEPS):
            losses.append(step_fn(run, s))
            mgr.step(s + 1, loss=losses[-1])
        mgr.save(STEPS, blocking=True)
        assert mgr.close() == []
        saved = _states(run)

    fresh = build(1)
    with sc.CheckpointManager(tmp_path, eval_every=1, max_interval=3600, min_interval=0) as mgr:
        mgr.register(**fresh)
        before = _states(fresh)
        restored_step = mgr.restore()
        for s in range(STEPS, 2 * STEPS):
            losses.append(step_fn(fresh, s))
            mgr.step(s + 1, loss=losses[-1])

    return _Resumed(
        restored_step=restored_step,
        ref_losses=ref_losses,
        losses=losses,
        ref_state=_states(ref),
        state=_states(fresh),
        changed_by_restore=_differences(before, saved, "state"),
        fresh=fresh,
    )


DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")],
    ),
]


@pytest.fixture
def deterministic(device: str) -> Any:
    """CUDA: deterministic kernels (CUBLAS_WORKSPACE_CONFIG is set in conftest.py before any CUDA
    work), TF32 off, so the reference and the resumed run take the same arithmetic."""
    if device != "cuda":
        yield
        return
    before = (torch.are_deterministic_algorithms_enabled(), torch.backends.cuda.matmul.allow_tf32)
    torch.use_deterministic_algorithms(True)
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0])
        torch.backends.cuda.matmul.allow_tf32 = before[1]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("opt_cls", OPTIMIZERS, ids=lambda c: c.__name__)
def test_every_optimizer_round_trips_bit_exactly(tmp_path, opt_cls, device, deterministic):
    def build(seed: int) -> dict[str, Any]:
        model = _model(opt_cls, seed, device)
        return {"model": model, "optimizer": _optimizer(opt_cls, model)}

    r = _run(tmp_path, build, lambda objs, s: _train_step(objs["model"], objs["optimizer"], s))
    assert r.restored_step == STEPS
    # Not vacuous: the fresh objects' weights (another seed) differed from the saved ones.
    assert any(d.startswith("state/model/") for d in r.changed_by_restore), r.changed_by_restore
    assert r.losses == r.ref_losses
    assert _differences(r.state, r.ref_state, "state") == []


@pytest.mark.parametrize("sched_cls", SCHEDULERS, ids=lambda c: c.__name__)
def test_every_scheduler_round_trips_bit_exactly(tmp_path, sched_cls):
    def build(seed: int) -> dict[str, Any]:
        model = _model(torch.optim.AdamW, seed)
        opt = _optimizer(torch.optim.AdamW, model)
        return {"model": model, "optimizer": opt, "scheduler": _scheduler(sched_cls, opt)}

    def step(objs: dict[str, Any], s: int) -> float:
        loss = _train_step(objs["model"], objs["optimizer"], s)
        _sched_step(objs["scheduler"], loss)
        return loss

    r = _run(tmp_path, build, step)
    assert r.restored_step == STEPS
    # Not vacuous: a freshly built scheduler's state (epoch 0) differed from the saved one's.
    assert any(d.startswith("state/scheduler/") for d in r.changed_by_restore), r.changed_by_restore
    assert r.losses == r.ref_losses
    assert _differences(r.state, r.ref_state, "state") == []


def test_grad_scaler_round_trips_bit_exactly(tmp_path):
    def build(seed: int) -> dict[str, Any]:
        model = _model(torch.optim.AdamW, seed)
        # growth_interval=2: the scale doubles within the run, so its state really moves.
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
        return {"model": model, "optimizer": _optimizer(torch.optim.AdamW, model), "scaler": scaler}

    def step(objs: dict[str, Any], s: int) -> float:
        return _train_step(objs["model"], objs["optimizer"], s, scaler=objs["scaler"])

    r = _run(tmp_path, build, step)
    assert r.restored_step == STEPS
    assert r.losses == r.ref_losses
    assert _differences(r.state, r.ref_state, "state") == []
    assert r.fresh["scaler"].get_scale() > 2.0**10  # the scale grew: the state compared really moved


def test_the_zoo_is_the_whole_module():
    """What was discovered is what torch has: the optimizers and schedulers named in the issue
    are in the lists (a discovery that found nothing would make the tests above vacuous)."""
    names = {c.__name__ for c in OPTIMIZERS}
    assert {"SGD", "Adam", "AdamW", "LBFGS", "SparseAdam", "Adagrad", "RMSprop", "Rprop"} <= names
    assert {"Adafactor", "Muon"} & names == {"Adafactor", "Muon"} & {n for n in dir(torch.optim)}
    scheds = {c.__name__ for c in SCHEDULERS}
    assert {"StepLR", "OneCycleLR", "SequentialLR", "ChainedScheduler", "ReduceLROnPlateau"} <= scheds


# ---------------------------------------------------------------- layouts that are not the parameter's


def _trained(opt_cls: type, seed: int, width: int = 8) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, width), torch.nn.Tanh(), torch.nn.Linear(width, 3))
    opt = opt_cls(model.parameters())
    x = torch.randn(16, 6)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        return loss

    for _ in range(3):
        opt.step(closure)
    return model, opt


def test_lbfgs_history_lists_round_trip_in_order_with_their_dtypes(tmp_path):
    torch.set_default_dtype(torch.float64)  # a float64 model: its LBFGS history is float64
    try:
        model, opt = _trained(torch.optim.LBFGS, 0)
        model2, opt2 = _trained(torch.optim.LBFGS, 5)
    finally:
        torch.set_default_dtype(torch.float32)
    state = opt.state[next(iter(model.parameters()))]
    assert isinstance(state["old_dirs"], list) and len(state["old_dirs"]) >= 2
    with sc.CheckpointManager(tmp_path) as mgr:
        mgr.register(model=model, optimizer=opt)
        mgr.save(3, blocking=True)
    with sc.CheckpointManager(tmp_path) as mgr:
        mgr.register(model=model2, optimizer=opt2)
        assert mgr.restore() == 3
    restored = opt2.state[next(iter(model2.parameters()))]
    assert isinstance(restored["old_dirs"], list) and restored["old_dirs"][0].dtype == torch.float64
    assert _differences(opt2.state_dict(), opt.state_dict(), "optimizer") == []


class _History:
    """A stateful object whose state is lists and tuples of tensors of mixed dtypes (what an
    optimizer's ``load_state_dict`` would cast to the parameter's dtype, so checked here, where
    smartckpt hands over exactly what it stored)."""

    def __init__(self, hist: Any) -> None:
        self.hist = hist

    def state_dict(self) -> dict[str, Any]:
        return {"hist": self.hist}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.hist = sd["hist"]


def test_lists_and_tuples_of_tensors_keep_order_and_dtypes(tmp_path):
    g = torch.Generator().manual_seed(0)
    hist = [
        torch.randn(5, generator=g),
        torch.randn(3, generator=g, dtype=torch.float64),
        (torch.randn(4, generator=g).half(), torch.arange(6, dtype=torch.int32), torch.tensor(True)),
        [torch.randn(2, 2, generator=g).to(torch.bfloat16)],
    ]
    with sc.CheckpointManager(tmp_path) as mgr:
        mgr.register(history=_History(hist))
        mgr.save(1, blocking=True)
    back = _History([])
    with sc.CheckpointManager(tmp_path) as mgr:
        mgr.register(history=back)
        assert mgr.restore() == 1
    assert isinstance(back.hist, list) and isinstance(back.hist[2], tuple) and isinstance(back.hist[3], list)
    assert _differences(back.hist, hist, "hist") == []


@pytest.mark.parametrize("with_model", [False, True], ids=["optimizer-alone", "model-and-optimizer"])
@pytest.mark.parametrize(
    "opt_cls", [torch.optim.AdamW, torch.optim.LBFGS, torch.optim.Adafactor], ids=lambda c: c.__name__
)
def test_a_checkpoint_of_another_model_is_refused_with_the_entry_and_both_shapes(
    tmp_path, opt_cls, with_model
):
    model, opt = _trained(opt_cls, 0, width=8)
    with sc.CheckpointManager(tmp_path) as mgr:
        mgr.register(**({"model": model} if with_model else {}), optimizer=opt)
        mgr.save(3, blocking=True)
    other, other_opt = _trained(opt_cls, 1, width=12)
    before_opt = copy.deepcopy(other_opt.state_dict())
    before_model = copy.deepcopy(other.state_dict())
    with sc.CheckpointManager(tmp_path) as mgr:
        mgr.register(**({"model": other} if with_model else {}), optimizer=other_opt)
        with pytest.raises(StateMismatchError) as err:
            mgr.restore()
    msg = str(err.value)
    assert "\n" not in msg
    # the model's own entry when it is registered, else the optimizer's check names the parameter
    if with_model:
        assert re.fullmatch(
            r"model/0\.(weight|bias): checkpoint shape (8|8x6) does not match the model's (12|12x6)", msg
        ), msg
    else:
        assert msg == "optimizer/param_groups: parameter 0 has shape 8x6 in the checkpoint, 12x6 here", msg
    # nothing was loaded: the live objects are as they were
    assert _differences(other_opt.state_dict(), before_opt, "optimizer") == []
    assert _differences(other.state_dict(), before_model, "model") == []


def test_a_moment_of_another_shape_is_refused_against_the_optimizers_own_state(tmp_path):
    """Same parameter shapes, but the live optimizer already holds a state whose entry has another
    shape: the entry is compared against that state and named with both shapes."""
    _, opt = _trained(torch.optim.AdamW, 0)
    with sc.CheckpointManager(tmp_path) as mgr:
        mgr.register(optimizer=opt)
        mgr.save(3, blocking=True)
    (manifest,) = (tmp_path / "manifests").iterdir()
    doc = json.loads(manifest.read_text())
    assert doc["objects"]["optimizer"]["param_shapes"]["0"] == [8, 6]
    torch.manual_seed(0)
    fresh = torch.optim.AdamW(
        torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).parameters()
    )
    p0 = fresh.param_groups[0]["params"][0]
    fresh.state[p0] = {"exp_avg": torch.zeros(3), "exp_avg_sq": torch.zeros(8, 6), "step": torch.tensor(1.0)}
    with sc.CheckpointManager(tmp_path) as mgr:
        mgr.register(optimizer=fresh)
        with pytest.raises(
            StateMismatchError,
            match=r"^optimizer/state/0/exp_avg: checkpoint shape 8x6 does not match the optimizer's 3$",
        ):
            mgr.restore()


def test_a_fresh_optimizer_accepts_a_factored_state(tmp_path):
    """Adafactor's row/column factors (16x1, 1x8 for a 16x8 weight) restore into an optimizer
    that has no state yet, and into one that has (compared against its own entries)."""
    model, opt = _trained(torch.optim.Adafactor, 0)
    assert opt.state[model[0].weight]["col_var"].shape != model[0].weight.shape
    with sc.CheckpointManager(tmp_path, precision="bf16") as mgr:
        mgr.register(model=model, optimizer=opt)
        mgr.save(3, blocking=True)
    for steps_before in (0, 2):
        torch.manual_seed(7)
        m2 = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        o2 = torch.optim.Adafactor(m2.parameters())
        for _ in range(steps_before):
            m2(torch.randn(4, 6)).sum().backward()
            o2.step()
        with sc.CheckpointManager(tmp_path, precision="bf16") as mgr:
            mgr.register(model=m2, optimizer=o2)
            assert mgr.restore() == 3
        # bf16 reduces per-element moments only (the biases' `variance`): the factors are exact
        for pid in (0, 2):  # the two weights
            for key in ("row_var", "col_var", "step"):
                assert (
                    _differences(o2.state_dict()["state"][pid][key], opt.state_dict()["state"][pid][key], key)
                    == []
                )
        bias_var = o2.state_dict()["state"][1]["variance"]
        assert bias_var.shape == model[0].bias.shape
        assert torch.allclose(bias_var, opt.state_dict()["state"][1]["variance"], rtol=1e-2)
