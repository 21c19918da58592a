"""Load a verified checkpoint into the registered objects, in place.

Everything is built and checked first (keys, shapes, optimizer parameter groups); only then is
``load_state_dict`` called on each object, so a mismatch leaves every object untouched. Modules
copy into their existing parameters, so optimizers keep their references.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from smartckpt_cli.errors import CheckpointCorrupt, StateMismatchError
from smartckpt_cli.state.data import LoaderState, load_stateful_loader
from smartckpt_cli.state.optstate import check_optimizer
from smartckpt_cli.state.tree import dtensor_specs, find_mesh, flatten, tensor_keys, unflatten
from smartckpt_cli.store.journal import CheckpointRecord

__all__ = ["Loaded", "apply_checkpoint"]

logger = logging.getLogger(__name__)


@dataclass
class Loaded:
    """One checkpoint read and verified into memory (by the engine's restore), ready to apply."""

    record: CheckpointRecord
    manifest: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    skipped_tiers: set[str] = field(default_factory=set)


def _shape(t: torch.Tensor) -> str:
    return "x".join(map(str, t.shape)) or "scalar"


def _check_module(name: str, ckpt: dict[str, torch.Tensor], current: dict[str, torch.Tensor]) -> None:
    missing = sorted(set(current) - set(ckpt))
    extra = sorted(set(ckpt) - set(current))
    if missing:
        raise StateMismatchError(
            f"checkpoint has no entry for {missing[0]} ({len(missing)} missing in '{name}')"
        )
    if extra:
        raise StateMismatchError(
            f"checkpoint entry {extra[0]} does not exist in '{name}' ({len(extra)} unexpected)"
        )
    for key, t in ckpt.items():
        if t.shape != current[key].shape:
            raise StateMismatchError(
                f"{key}: checkpoint shape {_shape(t)} does not match the model's {_shape(current[key])}"
            )


def _check_global(saved: Any, live: Any) -> None:
    """Sharded entries: the global shapes, identical on every rank, so that a checkpoint of
    another model is refused by every rank alike (local shards may match by chance)."""
    now = dtensor_specs(live)
    for key, (shape, _) in dtensor_specs(saved).items():
        if key in now and now[key][0] != shape:
            raise StateMismatchError(
                f"{key}: checkpoint shape {_shape(torch.empty(shape, device='meta'))} does not match "
                f"the model's {_shape(torch.empty(now[key][0], device='meta'))}"
            )


def apply_checkpoint(loaded: Loaded, objects: dict[str, tuple[str, Any]]) -> None:
    """Load ``loaded`` into ``objects`` (name to kind and object): every state is built and
    checked before the first ``load_state_dict``, so a mismatch leaves every object untouched."""
    plan = _build_states(loaded, objects)
    _load_states(plan, loaded.manifest.get("resharded_from"))


def _build_states(loaded: Loaded, objects: dict[str, tuple[str, Any]]) -> list[tuple[str, Any, Any]]:
    """Each object in the checkpoint with the state to load into it, checked against it."""
    saved = loaded.manifest["objects"]
    not_stored = set(loaded.manifest.get("not_stored", []))
    entries = loaded.manifest["entries"]
    plan: list[tuple[str, Any, Any]] = []
    # Sharded (DTensor) entries are rebuilt on the live model's mesh (same world size).
    mesh = next((m for _, o in objects.values() if (m := find_mesh(o.state_dict())) is not None), None)
    for name, (kind, obj) in objects.items():
        if name not in saved:
            logger.warning(
                "'%s' is not in the checkpoint of step %d; left as it is", name, loaded.record.step
            )
            continue
        skeleton = saved[name]["tree"]
        live_tree, current = flatten(obj.state_dict(), name)
        tensors, reset_l2 = _tensors_for(loaded, name, skeleton, current, not_stored, entries)
        sd = unflatten(skeleton, tensors, mesh)
        if kind == "module":
            _check_global(skeleton, live_tree)
            _check_module(name, {k: t for k, t in tensors.items()}, current)
        elif kind == "optimizer":
            if reset_l2:
                # L2 was corrupt and on_l2_corrupt="reset": keep hyperparameters, drop moments; the
                # optimizer re-initialises them at its next step.
                sd["state"] = {}
            check_optimizer(name, sd, obj, saved[name].get("param_shapes"))
        plan.append((name, obj, sd))
    return plan


def _tensors_for(
    loaded: Loaded,
    name: str,
    skeleton: Any,
    current: dict[str, torch.Tensor],
    not_stored: set[str],
    entries: dict[str, Any],
) -> tuple[dict[str, torch.Tensor], bool]:
    """The tensors of one object's skeleton, and whether its L2 entries were skipped (to reset)."""
    tensors: dict[str, torch.Tensor] = {}
    reset_l2 = False
    for key in tensor_keys(skeleton):
        if key in loaded.tensors:
            tensors[key] = loaded.tensors[key]
        elif key in not_stored and key in current:
            tensors[key] = current[key]  # L4: not stored, reset to the live value
        elif key in not_stored:
            raise StateMismatchError(
                f"{key} is not stored (tier L4) and '{name}' has no such entry now to keep"
            )
        elif "L2" in loaded.skipped_tiers and entries.get(key, {}).get("tier") == "L2":
            reset_l2 = True
            tensors[key] = torch.empty(0)
        else:
            raise CheckpointCorrupt(f"step {loaded.record.step}: entry {key} is missing", tier="L1")
    return tensors, reset_l2


def _load_states(plan: list[tuple[str, Any, Any]], resharded: Any) -> None:
    """``load_state_dict`` on each object of a checked plan."""
    # Another world size (engine/reshard.py): loader positions are carried by their own rules
    # and may still refuse, so they go first, before anything else has changed.
    plan.sort(key=lambda item: not isinstance(item[1], LoaderState))
    for name, obj, sd in plan:
        try:
            if resharded is not None and isinstance(obj, LoaderState):
                obj.load_state_dict(sd, world=int(resharded))
                if (line := obj.describe_reshard()) is not None:
                    logger.info("%s", line)
                continue
            if resharded is not None and _stateful_loader(obj):
                load_stateful_loader(obj, sd, saved_world=int(resharded), world=_world())
                continue
            obj.load_state_dict(sd)
        except StateMismatchError as err:
            if isinstance(obj, LoaderState):  # which loader: "data", "val_loader", ...
                raise StateMismatchError(f"DataLoader '{name}': {err}") from None
            raise
        except (RuntimeError, ValueError, KeyError) as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise StateMismatchError(f"loading into {type(obj).__name__} failed: {first}") from err


def _stateful_loader(obj: Any) -> bool:
    """A DataLoader with its own ``state_dict`` (torchdata's ``StatefulDataLoader``)."""
    from torch.utils.data import DataLoader

    return isinstance(obj, DataLoader) and hasattr(obj, "load_state_dict")


def _world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
