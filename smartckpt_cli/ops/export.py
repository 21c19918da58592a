"""``smartckpt export``: one checkpoint as a standard file that loads without smartckpt.

The checkpoint is read and verified completely (as a restore does), each registered object's
``state_dict`` is rebuilt from its tagged-JSON skeleton and tensors (``statetree.unflatten``) and
written as:

- ``torch``: ``torch.save`` of ``{name: state_dict, ...}`` plus ``"smartckpt"`` metadata; with
  ``--weights-only`` and a single model, that model's ``state_dict`` itself, so
  ``model.load_state_dict(torch.load(out, weights_only=True))`` works as it is. The file is
  checked with ``torch.load(weights_only=True)`` before it gets its name.
- ``safetensors``: flat tensors named ``<object>/<path>`` (with ``--weights-only`` and a single
  model, its own ``state_dict`` keys); the non-tensor state (hyperparameters, step counters) goes
  into the header metadata as JSON.

A checkpoint written by several ranks is consolidated into one file: it is read as a restore on
one process would read it (``engine.reshard.load_resharded`` with rank 0 of world size 1), so
every sharded tensor (FSDP2 / DTensor ``Shard``) is whole, assembled from all the ranks' parts,
and loads into an unsharded model; the rest (replicated weights, RNG, data position) is rank 0's.
A layout that cannot be carried to one process (a 2-D mesh, optimizer state that differs between
ranks without being sharded) is refused in one line (exit 2).

Values ``torch.load(weights_only=True)`` refuses are converted: NumPy arrays become tensors,
bytes stay bytes. Entries of tier L4 (never stored) are exported as ``None``. The output is
written to a temporary name and renamed: an existing file is never overwritten unless asked.
"""

from __future__ import annotations

import io
import json
import logging
import os
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import torch

from smartckpt_cli.engine.reshard import load_resharded, part_count
from smartckpt_cli.engine.restore import load_checkpoint
from smartckpt_cli.errors import CheckpointCorrupt, NoCheckpointError, StateMismatchError, UsageError
from smartckpt_cli.state.apply import Loaded
from smartckpt_cli.state.dtypes import dtype_name
from smartckpt_cli.state.tree import tensor_keys, unflatten
from smartckpt_cli.store.checkpoints import candidates
from smartckpt_cli.store.directory import StoreDir

__all__ = ["FORMATS", "ExportResult", "build_state", "export"]

logger = logging.getLogger(__name__)

FORMATS = ("torch", "safetensors")


@dataclass
class ExportResult:
    path: Path
    step: int
    id: str
    format: str
    objects: list[str]
    tensors: int
    bytes: int
    not_stored: list[str]
    world_size: int = 1  # ranks that wrote the checkpoint (consolidated into one file when > 1)


def build_state(
    manifest: dict[str, Any], tensors: dict[str, torch.Tensor], *, weights_only: bool
) -> tuple[dict[str, Any], list[str]]:
    """Pure: {object name: state_dict} rebuilt from a loaded checkpoint, and the L4 keys that
    were not stored (exported as None)."""
    missing: list[str] = []
    full = dict(tensors)
    for obj in manifest["objects"].values():
        for key in tensor_keys(obj["tree"]):
            if key not in full:
                missing.append(key)
    out: dict[str, Any] = {}
    for name, obj in manifest["objects"].items():
        if weights_only and obj.get("kind") != "module":
            continue
        skeleton = _numpy_as_tensors(obj["tree"])
        out[name] = unflatten(skeleton, _Defaulting(full))
    return out, missing


class _Defaulting(dict[str, Any]):
    """Tensors by key; a key never stored (L4) reads as None."""

    def __missing__(self, key: str) -> None:
        return None


def _numpy_as_tensors(node: Any) -> Any:
    """``{"__np": key}`` (a NumPy array in the state) read back as a tensor: loadable with
    ``torch.load(weights_only=True)``."""
    if isinstance(node, list):
        return [_numpy_as_tensors(v) for v in node]
    if isinstance(node, dict):
        if len(node) == 1 and "__np" in node:
            return {"__t": node["__np"]}
        return {k: _numpy_as_tensors(v) for k, v in node.items()}
    return node


def _pick(store: StoreDir, step: int | None) -> Any:
    state = store.journal.read()
    if step is None:
        live = candidates(state.records)
        if not live:
            raise NoCheckpointError(f"{store.root} has no live healthy checkpoint to export")
        return live[0], state.store_id
    hit = sorted((r for r in state.records if r.step == step and not r.pruned), key=lambda r: -r.position)
    if not hit:
        steps = ", ".join(str(r.step) for r in candidates(state.records)) or "none"
        raise UsageError(f"no checkpoint of step {step} in this store (live steps: {steps})")
    return hit[0], state.store_id


def export(
    store: StoreDir,
    out: Path,
    *,
    step: int | None = None,
    fmt: str = "torch",
    weights_only: bool = False,
    force: bool = False,
) -> ExportResult:
    _refuse_bad_args(out, fmt, force)
    rec, store_id, loaded = _load_chosen(store, step)
    state, missing = build_state(loaded.manifest, loaded.tensors, weights_only=weights_only)
    if weights_only and not state:
        raise UsageError(f"step {rec.step} holds no model (nn.Module) to export with --weights-only")
    meta = {"step": rec.step, "id": rec.id, "store_id": store_id, "utc": loaded.manifest["meta"].get("utc")}
    world = part_count(rec)
    if world > 1:
        meta["world_size"] = world  # the ranks that wrote it; the file holds whole tensors
    single = weights_only and len(state) == 1
    payload: Any = next(iter(state.values())) if single else state
    if fmt == "torch":
        data = _torch_bytes(payload if single else {**state, "smartckpt": meta})
    else:
        data = _safetensors_bytes(payload, meta, single)
    _write_atomically(out, data)
    n_tensors = sum(1 for _ in _tensors_of(payload))
    return ExportResult(out, rec.step, rec.id, fmt, list(state), n_tensors, len(data), missing, world)


def _refuse_bad_args(out: Path, fmt: str, force: bool) -> None:
    """Bad input is refused before anything is read: a checkpoint may take minutes to load."""
    if fmt not in FORMATS:
        raise UsageError(f"--format must be one of {', '.join(FORMATS)}, not {fmt!r}")
    if out.exists() and (out.is_dir() or not force):
        raise UsageError(
            f"{out} is a directory; give a file name"
            if out.is_dir()
            else f"{out} exists; choose another name or pass --force to replace it"
        )
    if not out.parent.is_dir():
        raise UsageError(f"directory {out.parent} does not exist")
    if fmt == "safetensors":
        try:
            import safetensors.torch  # noqa: F401
        except ImportError:
            raise UsageError(
                "--format safetensors needs the safetensors package (pip install safetensors)"
            ) from None


def _load_chosen(store: StoreDir, step: int | None) -> tuple[Any, str | None, Loaded]:
    """The checkpoint to export (``step``'s, else the newest live one), read and verified, with
    the store id."""
    for attempt in range(3):
        rec, store_id = _pick(store, step)
        try:
            loaded = _load(store, rec, store_id)
            break
        except CheckpointCorrupt as err:
            # A running job may prune the checkpoint while it is being read: that is not
            # corruption. Pick again (the newest live one) unless a step was asked for.
            pruned = any(r.id == rec.id and r.pruned for r in store.journal.read().records)
            if not pruned and step is None:
                raise CheckpointCorrupt(_damaged_newest(store, rec, err), tier=err.tier) from None
            if not pruned or attempt == 2:
                raise
            if step is not None:
                raise UsageError(
                    f"step {rec.step} was pruned by the running job while being exported"
                ) from None
    return rec, store_id, loaded


def _write_atomically(out: Path, data: bytes) -> None:
    """A temporary name, fsynced, then renamed: ``out`` is never seen half-written, and an
    existing file stays whole until the new one replaces it."""
    tmp = out.with_name(f".{out.name}.tmp.{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            tmp.unlink()


def _damaged_newest(store: StoreDir, rec: Any, err: CheckpointCorrupt) -> str:
    """The newest checkpoint does not verify: say so, and name the newest one that does (every
    blob re-hashed, as the export would), so the user picks it with --step knowingly."""
    from smartckpt_cli.ops.verify import check

    state = store.journal.read()
    line = (
        f"the newest checkpoint (step {rec.step}) is damaged: {str(err).removeprefix(f'step {rec.step}: ')}"
    )
    for older in candidates(state.records):
        if older.position >= rec.position:
            continue
        (result,), _, _ = check(store, [older], state.store_id)
        if not result.problems:
            return (
                f"{line}; the newest checkpoint that verifies is step {older.step}: "
                f"smartckpt export {store.root} OUT --step {older.step}"
            )
    return f"{line}; no older checkpoint verifies either"


def _load(store: StoreDir, rec: Any, store_id: str | None) -> Loaded:
    """The checkpoint read and verified; one written by several ranks with every sharded tensor
    assembled whole from all the parts (a restore on one process)."""
    if part_count(rec) == 1:
        return load_checkpoint(store.storage, store.blobs, rec, store_id)
    try:
        loaded, _report = load_resharded(store.storage, store.blobs, rec, store_id, 0, 1)
    except StateMismatchError as err:
        raise StateMismatchError(
            f"step {rec.step} (written by {part_count(rec)} ranks) cannot be consolidated into one file: {err}"
        ) from None
    return loaded


def _torch_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    data = buf.getvalue()
    try:
        torch.load(io.BytesIO(data), weights_only=True)
    except Exception as err:  # pragma: no cover - a value type torch's safe loader refuses
        raise UsageError(f"the state cannot be exported for torch.load(weights_only=True): {err}") from err
    return data


def _tensors_of(node: Any, path: str = "") -> Any:
    if isinstance(node, torch.Tensor):
        yield path, node
    elif isinstance(node, dict):
        for k, v in node.items():
            yield from _tensors_of(v, f"{path}/{k}" if path else str(k))
    elif isinstance(node, list | tuple):
        for i, v in enumerate(node):
            yield from _tensors_of(v, f"{path}/{i}" if path else str(i))


def _skeleton(node: Any) -> Any:
    """JSON of the non-tensor state: tensors replaced by their key in the file."""
    if isinstance(node, torch.Tensor):
        return "<tensor>"
    if isinstance(node, dict):
        return {str(k): _skeleton(v) for k, v in node.items()}
    if isinstance(node, list | tuple):
        return [_skeleton(v) for v in node]
    if isinstance(node, bytes):
        return node.hex()
    if isinstance(node, float) and node != node:
        return "nan"
    if node is None or isinstance(node, bool | int | float | str):
        return node
    return str(node)


def _safetensors_bytes(payload: Any, meta: dict[str, Any], single: bool) -> bytes:
    from safetensors.torch import save

    tensors = {}
    for key, t in _tensors_of(payload):
        if not _safetensors_has(t.dtype):
            raise UsageError(
                f"safetensors has no encoding for dtype {dtype_name(t.dtype)} (entry {key}); "
                "use --format torch"
            )
        tensors[key] = t.detach().contiguous().clone() if not t.is_contiguous() else t.detach()
    header = {"smartckpt": json.dumps(meta)}
    if not single:
        header["state"] = json.dumps(_skeleton(payload), allow_nan=True)
    return bytes(save(_unshare(tensors), metadata=header))


@cache
def _safetensors_has(dtype: torch.dtype) -> bool:
    """Whether the installed safetensors writes ``dtype`` so that it reads back as it was (asked
    of its public ``save``/``load``, since the set grows with its versions; an odd length, since
    some versions write float4 but cannot slice or read it)."""
    from safetensors.torch import load, save

    probe = torch.zeros(3, dtype=dtype)
    try:
        back = load(save({"probe": probe}))["probe"]
    except Exception:  # safetensors raises KeyError, ValueError or its own SafetensorError
        return False
    return back.dtype == dtype and back.shape == probe.shape


def _unshare(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors sharing memory (tied weights): give each its own copy."""
    seen: set[int] = set()
    out = {}
    for k, t in tensors.items():
        ptr = t.untyped_storage().data_ptr() if t.numel() else -1
        out[k] = t.clone() if ptr in seen else t
        if ptr >= 0:
            seen.add(ptr)
    return out
