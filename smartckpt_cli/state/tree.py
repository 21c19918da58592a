"""Turn any ``state_dict()`` into (tagged JSON skeleton, tensors) and back, without pickle.

Tensors are replaced in the skeleton by ``{"__t": key}`` and returned separately, keyed by a
readable path such as ``optimizer/state/0/exp_avg``; the tier rules match on those paths. Values
JSON cannot carry faithfully are tagged: tuples, dicts with non-string keys, non-finite floats,
bytes, dtypes, numpy arrays. Anything else is refused with the path of the offending value, so a
checkpoint never needs code execution to load.
"""

from __future__ import annotations

import base64
import math
from typing import Any

import numpy as np
import torch

from smartckpt_cli.errors import UnsupportedValueError
from smartckpt_cli.state.dtypes import dtype_name

__all__ = ["dtensor_specs", "find_mesh", "flatten", "local_tensor", "rebuild_dtensor", "unflatten"]

_TAGS = ("__t", "__dt", "__np", "__tuple", "__map", "__float", "__bytes", "__dtype", "__device")


def _plain_key(k: object) -> bool:
    return isinstance(k, str) and not k.startswith("__")


def flatten(obj: Any, prefix: str) -> tuple[Any, dict[str, torch.Tensor]]:
    """Returns (skeleton, {key: tensor}); keys are ``prefix/segment/...``."""
    tensors: dict[str, torch.Tensor] = {}

    def walk(value: Any, path: str) -> Any:
        if _is_dtensor(value):
            # FSDP2 / DTensor: each rank stores its local shard; the global shape and placements
            # let any world size rebuild it (engine/reshard.py reads the overlapping rows).
            tensors[path] = value.to_local().detach()
            return {"__dt": [path, list(value.shape), [_placement(p) for p in value.placements]]}
        if isinstance(value, torch.Tensor):
            if value.is_quantized:
                # Its value is its integer bytes *and* a scale/zero point torch keeps beside
                # them (and quantized dtypes are deprecated in torch): refuse, by name.
                raise UnsupportedValueError(
                    f"cannot store the quantized tensor at '{path}' ({dtype_name(value.dtype)}); "
                    "dequantize() it in state_dict() or leave it out of the checkpoint"
                )
            tensors[path] = value.detach()
            return {"__t": path}
        if isinstance(value, np.ndarray):
            tensors[path] = torch.from_numpy(np.ascontiguousarray(value))
            return {"__np": path}
        if value is None or isinstance(value, bool | int | str):
            return value
        if isinstance(value, float):
            return value if math.isfinite(value) else {"__float": repr(value)}
        if isinstance(value, np.generic):
            return walk(value.item(), path)
        if isinstance(value, dict):
            if all(_plain_key(k) for k in value):
                return {k: walk(v, f"{path}/{k}") for k, v in value.items()}
            return {"__map": [[walk(k, f"{path}/#key"), walk(v, f"{path}/{k}")] for k, v in value.items()]}
        if isinstance(value, tuple):  # torch.Size included
            return {"__tuple": [walk(v, f"{path}/{i}") for i, v in enumerate(value)]}
        if isinstance(value, list):
            return [walk(v, f"{path}/{i}") for i, v in enumerate(value)]
        if isinstance(value, bytes):
            return {"__bytes": base64.b64encode(value).decode()}
        if isinstance(value, torch.dtype):
            return {"__dtype": str(value).removeprefix("torch.")}
        if isinstance(value, torch.device):
            return {"__device": str(value)}
        raise UnsupportedValueError(
            f"cannot store {type(value).__name__} at '{path}' without pickle; "
            "return plain Python values or tensors from state_dict()"
        )

    return walk(obj, prefix), tensors


def _is_dtensor(value: Any) -> bool:
    return (
        isinstance(value, torch.Tensor) and type(value).__name__ == "DTensor" and hasattr(value, "to_local")
    )


def _placement(p: Any) -> str:
    if p.is_shard():
        return f"S{p.dim}"
    if p.is_replicate():
        return "R"
    raise UnsupportedValueError(f"cannot store a DTensor with placement {p} (only Shard and Replicate)")


def rebuild_dtensor(local: torch.Tensor, shape: list[int], placements: list[str], mesh: Any) -> torch.Tensor:
    """A DTensor from this rank's stored shard, on ``mesh`` (the live model's mesh)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    pl = [Shard(int(c[1:])) if c.startswith("S") else Replicate() for c in placements]
    stride: list[int] = []
    acc = 1
    for n in reversed(shape):
        stride.insert(0, acc)
        acc *= max(1, n)
    return DTensor.from_local(local, mesh, pl, run_check=False, shape=torch.Size(shape), stride=tuple(stride))


def find_mesh(obj: Any) -> Any:
    """The device mesh of the first DTensor in a state tree, or None."""
    if _is_dtensor(obj):
        return obj.device_mesh
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, list | tuple):
        for v in obj:
            mesh = find_mesh(v)
            if mesh is not None:
                return mesh
    return None


def unflatten(skeleton: Any, tensors: dict[str, torch.Tensor], mesh: Any = None) -> Any:
    def walk(node: Any) -> Any:
        if isinstance(node, list):
            return [walk(v) for v in node]
        if not isinstance(node, dict):
            return node
        if len(node) == 1:
            ((tag, val),) = node.items()
            if tag == "__t":
                return tensors[val]
            if tag == "__dt":
                if mesh is None:
                    # Nothing sharded now: a single process takes the tensor whole, which a
                    # restore at another world size assembled from every old shard.
                    if list(tensors[val[0]].shape) == list(val[1]):
                        return tensors[val[0]]
                    raise UnsupportedValueError(
                        f"'{val[0]}' was saved sharded (DTensor) but nothing registered is sharded now"
                    )
                return rebuild_dtensor(tensors[val[0]], val[1], val[2], mesh)
            if tag == "__np":
                return tensors[val].numpy()
            if tag == "__tuple":
                return tuple(walk(v) for v in val)
            if tag == "__map":
                return {walk(k): walk(v) for k, v in val}
            if tag == "__float":
                return float(val)
            if tag == "__bytes":
                return base64.b64decode(val)
            if tag == "__dtype":
                return getattr(torch, val)
            if tag == "__device":
                return torch.device(val)
        return {k: walk(v) for k, v in node.items()}

    return walk(skeleton)


def tensor_keys(skeleton: Any) -> list[str]:
    """Every tensor key referenced by a skeleton (in order)."""
    out: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, list):
            for v in node:
                walk(v)
        elif isinstance(node, dict):
            if len(node) == 1 and next(iter(node)) in ("__t", "__np"):
                out.append(next(iter(node.values())))
                return
            if len(node) == 1 and next(iter(node)) == "__dt":
                out.append(node["__dt"][0])
                return
            for v in node.values():
                walk(v)

    walk(skeleton)
    return out


def dtensor_specs(skeleton: Any) -> dict[str, tuple[list[int], list[str]]]:
    """``{key: (global shape, placements)}`` of every sharded (DTensor) entry of a skeleton."""
    out: dict[str, tuple[list[int], list[str]]] = {}

    def walk(node: Any) -> None:
        if isinstance(node, list):
            for v in node:
                walk(v)
        elif isinstance(node, dict):
            if len(node) == 1 and "__dt" in node:
                key, shape, placements = node["__dt"][:3]
                out[key] = (list(shape), list(placements))
                return
            for v in node.values():
                walk(v)

    walk(skeleton)
    return out


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (what this rank owns and saves); any other tensor as it is."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t
