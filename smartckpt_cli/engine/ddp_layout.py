"""DDP's gradient buckets carried across a restart, so that a resumed job sums its first
gradients in the order the interrupted job did.

Why. ``DistributedDataParallel`` all-reduces gradients bucket by bucket, each bucket one flat
buffer. A ring all-reduce (gloo's, NCCL's) starts the sum of an element at the rank that owns the
element's chunk of the buffer, so where a gradient lies in its bucket decides the order in which
the ranks' values are added. DDP builds its buckets in parameter order and, after the first
iteration, rebuilds them once in the order the gradients became ready
(``Reducer::rebuild_buckets``). A resumed job's first step therefore runs in the construction
layout where the uninterrupted job ran the same step in the rebuilt one: at two ranks ``a + b ==
b + a`` and nothing changes; at three and more, floating-point addition is not associative and
the weights differ in their last bits from then on (measured: a few hundred values of 1.1k at
3 and 4 ranks, by at most 3e-8).

What. At each save, :func:`record` reads the layout of every registered DDP from DDP's own logging
data (``rebuilt_per_bucket_param_indices``, filled at the sampled iterations once the buckets were
rebuilt) into the manifest's metadata, ``meta["ddp"] = {name: {"buckets": [[7, 6, ...], ...]}}``
(``"buckets": null``: this DDP will rebuild but its layout is not known yet: a checkpoint of its
first two steps, three with ``static_graph``). At a restore at the same world size, :func:`restore` builds the reducer of each
DDP again with the recorded layout, through DDP's own ``_ddp_init_helper`` (the path DDP's
``__setstate__`` takes to build a reducer), before its first forward; its one rebuild after the
first iteration then lands on the same layout. Where that cannot be done (a communication hook
registered on the reducer, DDP's mixed precision or Python reducer, layout not recorded) the
restore says so in one line and the reason is kept in ``CheckpointManager.resume_limits``.

These are private DDP attributes (torch 2.x); every access is guarded: a torch that lacks one
leaves the reducer as it is and the limit is reported, never an error in the training.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

__all__ = ["DDP_META", "find_ddp", "parse_layout", "record", "restore"]

logger = logging.getLogger(__name__)

DDP_META = "ddp"  # the key in a manifest's ``meta``

# The layout this process gave a DDP (restore): it holds until DDP's logging data shows the
# rebuilt layout (the third iteration after the reducer was built).
_laid: weakref.WeakKeyDictionary[Any, list[list[int]]] = weakref.WeakKeyDictionary()


def find_ddp(obj: Any) -> Any:
    """The ``DistributedDataParallel`` a registered object is, wraps (zero-code mode registers a
    wrapper with ``.module``), or is wrapped by: most scripts register the module they built
    (``net``) and train ``DDP(net)``; Lightning wraps its module twice. None when there is none."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    for candidate in (obj, getattr(obj, "module", None)):
        if isinstance(candidate, DDP):
            return candidate
    module = obj if hasattr(obj, "parameters") else getattr(obj, "module", None)
    return _wrapping(module) if module is not None else None


# registered module -> the DDP over its parameters (found once, by the parameters' identities)
_wrappers: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_looked: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
LOOKS = 3  # saves that look for a DDP built after the module was registered, then no more


def _wrapping(module: Any) -> Any:
    """The live DDP whose parameters are exactly ``module``'s (only under torch.distributed)."""
    import gc

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    try:
        found = _wrappers.get(module)
        if found is not None or _looked.get(module, 0) >= LOOKS:
            return found
        if not (dist.is_available() and dist.is_initialized()):
            return None
        _looked[module] = _looked.get(module, 0) + 1
        mine = {id(p) for p in module.parameters()}
    except TypeError:  # not weakly referenceable: no lookup
        return None
    if not mine:
        return None
    for o in gc.get_objects():
        if issubclass(type(o), DDP) and {id(p) for p in o.module.parameters()} == mine:
            _wrappers[module] = o
            return o
    return None


def parse_layout(text: str) -> list[list[int]]:
    """DDP's logging form of a layout, ``"5 4 3 2, 1 0"``, as ``[[5, 4, 3, 2], [1, 0]]``."""
    return [[int(i) for i in bucket.split()] for bucket in text.split(",") if bucket.strip()]


def _rebuilds(ddp: Any) -> bool:
    """Whether DDP rebuilds its buckets after the first iteration (``should_rebuild_buckets``)."""
    return bool(getattr(ddp, "static_graph", False) or not getattr(ddp, "find_unused_parameters", False))


def _layout(ddp: Any) -> list[list[int]] | None:
    """The bucket layout ``ddp`` reduces in from now on, or None when it is not known yet."""
    try:
        data = ddp._get_ddp_logging_data()
    except (AttributeError, RuntimeError):
        data = {}
    text = data.get("rebuilt_per_bucket_param_indices")
    if data.get("has_rebuilt_buckets") == 1 and isinstance(text, str) and text:
        return parse_layout(text)
    return _laid.get(ddp)


def record(objects: dict[str, tuple[str, Any]]) -> dict[str, Any]:
    """``meta["ddp"]`` of a save: the layout of every registered DDP that rebuilds its buckets
    (None where it is not known yet). Training thread, at a save only: a dict read per DDP."""
    out: dict[str, Any] = {}
    for name, (_, obj) in objects.items():
        ddp = find_ddp(obj)
        if ddp is not None and _rebuilds(ddp):
            out[name] = {"buckets": _layout(ddp)}
    return out


def _unsupported(ddp: Any) -> str | None:
    """Why the reducer of ``ddp`` cannot be built again here, or None."""
    if getattr(ddp, "_use_python_reducer", False):
        return "DDP runs its Python reducer (compiled DDP)"
    if getattr(ddp, "mixed_precision", None) is not None:
        return "DDP's own mixed_precision is set"
    if any(hasattr(p, "_in_backward_optimizers") for p in getattr(ddp, "_module_parameters", [])):
        return "an optimizer runs in the backward pass"
    try:
        hook = ddp._get_ddp_logging_data().get("comm_hook")
    except (AttributeError, RuntimeError):
        return "this torch has no DDP logging data"
    if hook:
        return f"a communication hook ({hook}) is registered on the reducer"
    for name in ("_build_params_for_reducer", "_build_debug_param_to_name_mapping", "_ddp_init_helper"):
        if not callable(getattr(ddp, name, None)):
            return f"this torch's DDP has no {name}"
    return None


def _relay(ddp: Any, buckets: list[list[int]]) -> str | None:
    """Build ``ddp``'s reducer again with ``buckets``; returns why not, or None when done."""
    import torch.distributed as dist

    why = _unsupported(ddp)
    if why is not None:
        return why
    params, sparse = ddp._build_params_for_reducer()
    if sorted(i for b in buckets for i in b) != list(range(len(params))):
        return f"the recorded layout names other parameters than the model's {len(params)}"
    names = ddp._build_debug_param_to_name_mapping(params)
    old = (ddp.reducer, ddp.logger)
    assign = dist._compute_bucket_assignment_by_size
    cap = int(getattr(ddp, "bucket_bytes_cap", 25 << 20))

    def recorded(*_: Any, **__: Any) -> tuple[list[list[int]], list[int]]:
        # DDP reverses the bucket list it is given (parameters defined first are reduced last).
        return [list(b) for b in reversed(buckets)], [cap] * len(buckets)

    dist._compute_bucket_assignment_by_size = recorded
    try:
        ddp._ddp_init_helper(params, sparse, names, ddp.static_graph)
        if ddp.static_graph:  # as DDP's __setstate__ does after building its reducer
            ddp.reducer._set_static_graph()
            ddp.logger._set_static_graph()
    except Exception as err:  # a torch whose internals moved: keep the reducer DDP built
        ddp.reducer, ddp.logger = old
        return f"building DDP's reducer again failed ({type(err).__name__}: {err})"
    finally:
        dist._compute_bucket_assignment_by_size = assign
    try:  # the old reducer's hooks on the gradient accumulators go (its destructor would too)
        old[0]._remove_autograd_hooks()
    except (AttributeError, RuntimeError):
        pass
    _laid[ddp] = [list(b) for b in buckets]
    return None


def restore(
    meta: dict[str, Any] | None, objects: dict[str, tuple[str, Any]], world: int, rank: int, step: int
) -> list[str]:
    """Give every restored DDP the bucket layout recorded at the save (module docstring). Call
    after the state is loaded and before the first forward, on every rank (the layouts are the
    same on every rank: rank 0's, broadcast by DDP when it rebuilt). Returns the limits: one line
    per DDP whose next step will not sum its gradients as the interrupted job did (only with 3 or
    more ranks: a sum of two numbers does not depend on the order); rank 0 logs them."""
    limits: list[str] = []
    recorded = meta if isinstance(meta, dict) else None
    for name, (_, obj) in objects.items():
        ddp = find_ddp(obj)
        if ddp is None or not _rebuilds(ddp):
            continue
        if getattr(ddp, "_has_rebuilt_buckets", False):
            continue  # it already reduces in its rebuilt layout (a restore after training began)
        entry = (recorded or {}).get(name)
        buckets = entry.get("buckets") if isinstance(entry, dict) else None
        if buckets:
            why = _relay(ddp, buckets)
            if why is None:
                logger.info(
                    "DDP '%s': gradient buckets laid out as at step %d (%d bucket(s))",
                    name,
                    step,
                    len(buckets),
                )
                continue
        elif recorded is None:
            why = "the checkpoint does not record DDP's gradient buckets (written by an older version)"
        elif not isinstance(entry, dict):
            why = "the checkpoint records no gradient buckets for it"
        else:
            why = "the checkpoint was taken before DDP had rebuilt its gradient buckets (its first two steps, three with static_graph)"
        if world >= 3:
            line = (
                f"DDP '{name}': the first step after this resume sums gradients over the {world} ranks in "
                f"another order than the interrupted run did ({why}); from here the weights are close "
                "to the uninterrupted run's, not bit-exact"
            )
            logger.log(logging.WARNING if rank == 0 else logging.INFO, "%s", line)
            limits.append(line)
    return limits
