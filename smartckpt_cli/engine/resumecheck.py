"""The resume check: does the first step after a restore compute what the interrupted run computed
at that same step?

A checkpoint holds what smartckpt can see (weights, optimizer, schedulers, RNG, data position). A
loop may carry more across a step boundary — a batch fetched before the optimizer step, an RNN's
hidden state, an unseeded RNG — and then the resume is not exact, silently. So after every
restore of step N, the loss of step N+1 and the L2 norm of its gradients are compared with what
the interrupted run computed at step N+1:

- *expected*, taken by the interrupted run. Zero-code mode saves step N from the optimizer
  pre-hook of step N+1, where step N+1's loss and gradients already exist: they go into the
  checkpoint's own manifest (``meta.next_step``), so a preemption checkpoint or one fetched from
  the remote tier carries them too. A loop with its own manager saves at ``step(N)``, before step
  N+1 exists: its values are taken at ``step(N+1)`` and go into the checkpoint's manifest while
  it is still being written (:class:`NextStepSlot`), else into the journal after the commit (a
  ``step_after`` event naming the checkpoint); a run that dies before that has no expectation.
- *got*, the same values of the same step after the restore; the verdict goes to the log (one
  line when not exact), to the journal (a ``resume_check`` event) and, under ``smartckpt run``,
  to the run record (``attempts[i].resume_check``).

The gradient norm is that of one optimizer's parameters (zero-code: the first optimizer to step;
a manager: the first registered), taken in its step pre-hook: after any clipping or unscaling
the loop does before ``opt.step()``. A step that does not follow a save or a restore takes
nothing: the check is armed for one step at a time.

:func:`judge` is the verdict, with its tolerance, as one pure function (:data:`CLOSE_RTOL`,
:func:`tolerance`); :class:`ResumeCheck` is the manager's doing part (training thread; its jobs
run on the manager's save thread).
"""

from __future__ import annotations

import contextlib
import logging
import math
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "CLOSE_RTOL",
    "FIELDS",
    "NextStepSlot",
    "ResumeCheck",
    "Values",
    "capture",
    "check_job",
    "expect_job",
    "expected_of",
    "grad_sumsq",
    "judge",
    "not_exact_line",
    "tolerance",
]

logger = logging.getLogger(__name__)

FIELDS = ("loss", "grad_norm")
# ``close``: every value within this relative distance of the expected one. Only where kernels are
# not deterministic (a GPU without torch.use_deterministic_algorithms): one step from identical
# state moves a loss there by ~1e-7 relative, while a skipped batch or a lost hidden state moves
# it (and the gradient norm far more) by percent.
CLOSE_RTOL = 1e-4

WHY = (
    "usual causes: a batch fetched before the optimizer step, a hidden state carried across steps, "
    'an unseeded RNG; see the README, section "Your loop"'
)


# ---------------------------------------------------------------------------- deciding (pure)


def tolerance(*, on_cpu_only: bool, deterministic: bool) -> float:
    """The relative tolerance of a resume: 0 (exact or differs) on CPU or with deterministic
    algorithms, :data:`CLOSE_RTOL` otherwise."""
    return 0.0 if on_cpu_only or deterministic else CLOSE_RTOL


def _num(v: Any) -> float | None:
    if v is None or isinstance(v, bool):
        return None
    try:
        return float(v)  # JSON keeps non-finite values as "nan", "inf", "-inf"
    except (TypeError, ValueError):
        return None


def _bits(x: float) -> bytes:
    return struct.pack("<d", x)


def judge(expected: dict[str, Any], got: dict[str, Any], rtol: float = 0.0) -> str | None:
    """``exact`` when every value both sides have is bit for bit the same; ``close`` when each is
    within ``rtol`` of the other, relative to the larger magnitude; ``differs`` otherwise; None
    when they share no value (nothing to compare)."""
    pairs = [(_num(expected.get(k)), _num(got.get(k))) for k in FIELDS]
    both = [(a, b) for a, b in pairs if a is not None and b is not None]
    if not both:
        return None
    if all(_bits(a) == _bits(b) or (math.isnan(a) and math.isnan(b)) for a, b in both):
        return "exact"
    if rtol > 0 and all(
        math.isfinite(a) and math.isfinite(b) and abs(a - b) <= rtol * max(abs(a), abs(b)) for a, b in both
    ):
        return "close"
    return "differs"


def _fmt(v: Any) -> str:
    x = _num(v)
    return "?" if x is None else f"{x:.8g}"


def not_exact_line(check: dict[str, Any], rtol: float) -> str:
    """The one line a resume that is not exact gets (``check``: a ``resume_check`` record)."""
    exp, got = check.get("expected") or {}, check.get("got") or {}
    seen = [
        f"{name.replace('_', ' ')} {_fmt(got.get(k))} where the interrupted run had {_fmt(exp.get(k))}"
        for k, name in zip(FIELDS, ("loss", "gradient_norm"), strict=True)
        if _num(exp.get(k)) is not None and _num(got.get(k)) is not None
    ]
    step = check.get("step")
    if check.get("verdict") == "close":
        return (
            f"smartckpt: resume check at step {step}: close, not bit-exact ({'; '.join(seen)}; within "
            f"the {rtol:g} relative tolerance of a device whose kernels are not deterministic)"
        )
    known = check.get("known")
    why = f"known cause: {known[0]}" if known else WHY
    return f"smartckpt: the resume is not exact: step {step} computes {'; '.join(seen)}; {why}"


def expected_of(
    manifest: dict[str, Any], cid: str, events: Callable[[], list[dict[str, Any]]]
) -> dict[str, Any] | None:
    """What the interrupted run computed at the step after checkpoint ``cid``: from its manifest
    (zero-code mode), else from the journal's ``step_after`` event for it (``events``: read only
    then). None when neither has it."""
    got = (manifest.get("meta") or {}).get("next_step")
    if isinstance(got, dict):
        return {k: got.get(k) for k in FIELDS}
    for ev in reversed(events()):
        if ev.get("event") == "step_after" and ev.get("id") == cid:
            return {k: ev.get(k) for k in FIELDS}
    return None


# ---------------------------------------------------------------------------- capturing


def _json(x: float) -> float | str:
    return x if math.isfinite(x) else repr(x)


@dataclass
class Values:
    """One step's loss and gradient norm, captured on the training thread and read back later
    (CUDA: through a pinned buffer and an event, so the training thread never waits)."""

    step: int
    ready: dict[str, float | str] = field(default_factory=dict)  # read at once (CPU, floats)
    names: list[str] = field(default_factory=list)  # ... and these from ``host`` once ``event`` passed
    host: torch.Tensor | None = None
    event: Any = None

    def read(self, timeout: float = 60.0) -> dict[str, Any]:
        out: dict[str, Any] = {k: None for k in FIELDS}
        out.update(self.ready)
        if self.host is not None:
            deadline = time.monotonic() + timeout
            while self.event is not None and not self.event.query():
                if time.monotonic() > deadline:
                    return out
                time.sleep(0.001)
            out.update({n: _json(float(v)) for n, v in zip(self.names, self.host.tolist(), strict=True)})
        return out


def grad_sumsq(optimizer: Any) -> torch.Tensor | None:
    """Σg² over ``optimizer``'s parameters' gradients (dense, local shards), in float64 on their
    device; None when it has none or they cannot be reduced together."""
    from smartckpt_cli.engine.distributed import local_tensor

    grads = [
        local_tensor(p.grad)
        for g in optimizer.param_groups
        for p in g["params"]
        if p.grad is not None and not p.grad.is_sparse
    ]
    if not grads:
        return None
    try:
        norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
        return torch.stack(norms).double().pow(2).sum()
    except (RuntimeError, TypeError) as err:  # several devices, exotic dtypes: no digest
        logger.debug("no gradient norm for the resume check: %s", err)
        return None


def capture(step: int, loss: Any, scale: Any, sumsq: torch.Tensor | None) -> Values:
    """The values of ``step``: its loss (divided by ``scale``, a GradScaler's, when given) and the
    gradient norm from ``sumsq``. Costs a few small device operations, at one step in a save."""
    vals = Values(step)
    parts: list[tuple[str, torch.Tensor]] = []
    if isinstance(loss, torch.Tensor):
        if loss.numel() == 1:
            t = loss.detach().reshape(()).double()
            parts.append(("loss", t / scale if scale is not None else t))
    elif isinstance(loss, int | float) and not isinstance(loss, bool):
        vals.ready["loss"] = _json(
            float(loss) / float(scale) if isinstance(scale, int | float) else float(loss)
        )
    if sumsq is not None:
        parts.append(("grad_norm", sumsq.sqrt()))
    on_device = []
    for name, t in parts:
        if t.device.type == "cpu":
            vals.ready[name] = _json(float(t))
        else:
            on_device.append((name, t))
    if on_device:
        vec = torch.stack([t.to(on_device[0][1].device) for _, t in on_device])
        vals.names = [n for n, _ in on_device]
        if vec.device.type == "cuda":
            vals.host = torch.empty(vec.shape, dtype=vec.dtype, pin_memory=True)
            vals.host.copy_(vec, non_blocking=True)
            vals.event = torch.cuda.Event()
            vals.event.record()
        else:
            vals.host = vec.cpu()
    return vals


class NextStepSlot:
    """Where the values of the step after a save go while that save's manifest is not written
    yet (a manager's save: ``step(N+1)`` comes while step N's blobs are being written): then they
    are in the checkpoint itself, like zero-code mode's. The training thread ``offer``s them; the
    writer calls ``close`` right before the manifest (save thread); an offer after that is
    refused, and the values go to the journal instead."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: Values | None = None
        self._closed = False

    def offer(self, values: Values) -> bool:
        with self._lock:
            if self._closed:
                return False
            self._values = values
            return True

    def close(self, snap: Any) -> None:
        with self._lock:
            self._closed, values = True, self._values
        if values is not None:
            snap.meta = {**snap.meta, "next_step": {"step": values.step, **values.read()}}


class ResumeCheck:
    """Armed for one step at a time: after a save of step N (record step N+1's values for that
    checkpoint) and after a restore of step N (compare step N+1's with the expected ones); both
    at once when a save follows a restore at once. The manager calls ``grads`` in its optimizer
    pre-hook and ``take`` in ``step()`` (zero-code mode: both from its own pre-hook); the jobs
    run on the manager's save thread."""

    def __init__(self) -> None:
        self.step = -1  # the step whose values are wanted; -1: none
        self.saved: Any = None  # the SaveHandle of the checkpoint of step - 1 (expect them)
        self.slot: NextStepSlot | None = None  # ... and its manifest's slot for them
        # (check) {"id", "step", "expected", "rtol"}, and "skip": why this resume cannot be compared
        self.restored: dict[str, Any] | None = None
        self.sumsq: torch.Tensor | None = None
        self.taken_grads = False

    def expect(self, step: int, handle: Any, slot: NextStepSlot | None = None) -> None:
        if step != self.step:
            self._arm(step)
        self.saved, self.slot = handle, slot

    def check(self, step: int, restored: dict[str, Any]) -> None:
        self._arm(step)
        self.restored = restored

    def _arm(self, step: int) -> None:
        self.step, self.saved, self.restored, self.sumsq, self.taken_grads = step, None, None, None, False
        self.slot = None

    def disarm(self) -> None:
        self._arm(-1)

    def grads(self, optimizer: Any) -> None:
        """The gradient digest of the armed step, from ``optimizer`` (once per step)."""
        if not self.taken_grads:
            self.taken_grads = True
            self.sumsq = grad_sumsq(optimizer)

    def take(self, step: int, loss: Any, scale: Any) -> tuple[Values, Any, dict[str, Any] | None] | None:
        """At the armed step: (its values, the save handle whose journal should get them or None,
        the restore to check them against or None), and disarmed; the values go into the save's
        own manifest instead while its slot still takes them. None at any other step (a step
        past the armed one disarms it: that step was missed)."""
        if step != self.step:
            if step > self.step >= 0:
                self.disarm()
            return None
        values = capture(step, loss, scale, self.sumsq)
        saved = self.saved if self.slot is None or not self.slot.offer(values) else None
        what = (values, saved, self.restored)
        self.disarm()
        return what


def expect_job(values: Values, handle: Any, append: Callable[[dict[str, Any]], None]) -> None:
    """Save thread, after the checkpoint's persist: its ``step_after`` journal event."""
    info = handle.wait() if handle is not None else None
    if info is None:
        return  # the save failed: nothing to expect from it
    append({"event": "step_after", "id": info.id, "step": values.step, **values.read()})


def check_job(
    values: Values,
    restored: dict[str, Any],
    append: Callable[[dict[str, Any]], None] | None,
    tell: Callable[..., None],
) -> dict[str, Any] | None:
    """Save thread: the verdict of a restore, said (one line when not exact), journalled
    (``append``: None on ranks that do not write the journal) and reported (``tell``)."""
    got = values.read()
    expected = restored.get("expected")
    rtol = float(restored.get("rtol", 0.0))
    verdict = judge(expected, got, rtol) if expected and not restored.get("skip") else None
    if verdict is None:
        why = (
            str(restored["skip"])
            if restored.get("skip")
            else "the interrupted run recorded nothing after it (it stopped right after that save, "
            "or the checkpoint predates the check)"
            if not expected
            else "no loss and no gradient norm to compare"
        )
        # Said, and recorded as a verdict: a resume nobody checked must not read as a clean one.
        logger.warning("smartckpt: resume check at step %d: unchecked (%s)", values.step, why)
        check = {"step": values.step, "verdict": "unchecked", "why": why, "expected": expected, "got": got}
        if append is not None:
            with contextlib.suppress(OSError):
                append({"event": "resume_check", "id": restored.get("id"), **check})
        tell(resume_check=check)
        return check
    check = {"step": values.step, "verdict": verdict, "expected": expected, "got": got}
    if verdict != "exact" and restored.get("known"):
        check["why"] = "; ".join(restored["known"])  # the record names the cause the restore knew
    if append is not None:
        try:
            append({"event": "resume_check", "id": restored.get("id"), **check})
        except OSError as err:
            logger.warning("resume check not journalled: %s", err)
    tell(resume_check=check)
    if verdict == "exact":
        logger.info("resume check at step %d: exact", values.step)
    else:
        logger.warning("%s", not_exact_line({**check, "known": restored.get("known")}, rtol))
    return check
