"""What an optimizer's state looks like beside its parameters: which entries are per-element
moments, and whether a checkpoint's optimizer state fits a live optimizer.

Optimizer state is not always shaped like its parameter. Adam's ``exp_avg``/``exp_avg_sq`` and
SGD's ``momentum_buffer`` are (per-element moments), but ``torch.optim.LBFGS`` keeps flat buffers
(``d``, ``prev_flat_grad``) and lists of them (``old_dirs``, ``old_stps``) in the state of its
first parameter, ``Adafactor`` keeps factored second moments (``row_var`` 16x1 and ``col_var``
1x8 for a 16x8 weight), and counters such as ``step`` are scalars.

So the save records each parameter's shape beside the optimizer's tree (``param_shapes``, by the
parameter's id in ``state_dict()["param_groups"]``), and the restore compares what is comparable:

* a parameter against the live one (another model is refused here, whatever the optimizer);
* a per-element moment (an entry shaped like its parameter *at save time*) against the live
  parameter;
* any other tensor against the live optimizer's own entry where it has one (an LBFGS that has
  already run, an Adafactor that has stepped), and against nothing where it has none yet.

Per-element moments are also the only entries the global ``precision`` reduces (tiers.py): the
bytes are there, and a factored or quasi-Newton state is small and exact by nature.
"""

from __future__ import annotations

from typing import Any

import torch

from smartckpt_cli.errors import StateMismatchError

__all__ = ["check_optimizer", "moment_keys", "param_shapes"]


def _shape(shape: Any) -> str:
    return "x".join(map(str, shape)) or "scalar"


def param_shapes(optimizer: Any, sd: dict[str, Any]) -> dict[str, list[int]]:
    """``{param id (as text): shape}`` for the parameters an optimizer's ``state_dict`` names.
    Empty for an object without torch's ``param_groups`` layout (nothing to compare then)."""
    groups_now = getattr(optimizer, "param_groups", None)
    groups_sd = sd.get("param_groups") if isinstance(sd, dict) else None
    if (
        not isinstance(groups_now, list)
        or not isinstance(groups_sd, list)
        or len(groups_now) != len(groups_sd)
    ):
        return {}
    shapes: dict[str, list[int]] = {}
    for g_sd, g_now in zip(groups_sd, groups_now, strict=True):
        ids, params = g_sd.get("params", []), g_now.get("params", [])
        if len(ids) != len(params):
            return {}
        for pid, p in zip(ids, params, strict=True):
            if isinstance(p, torch.Tensor):
                shapes[str(pid)] = list(p.shape)
    return shapes


def moment_keys(name: str, sd: dict[str, Any], shapes: dict[str, list[int]]) -> set[str]:
    """Flattened keys (``name/state/<pid>/<entry>``) of the per-element moments: state tensors
    shaped like their parameter."""
    out: set[str] = set()
    state = sd.get("state") if isinstance(sd, dict) else None
    if not isinstance(state, dict):
        return out
    for pid, entries in state.items():
        shape = shapes.get(str(pid))
        if shape is None or not isinstance(entries, dict):
            continue
        for key, value in entries.items():
            if isinstance(value, torch.Tensor) and list(value.shape) == shape:
                out.add(f"{name}/state/{pid}/{key}")
    return out


def _tensors(value: Any, path: str) -> list[tuple[str, torch.Tensor]]:
    """Tensors inside one state entry, lists and tuples included (LBFGS history), with paths."""
    if isinstance(value, torch.Tensor):
        return [(path, value)]
    if isinstance(value, list | tuple):
        return [pt for i, v in enumerate(value) for pt in _tensors(v, f"{path}/{i}")]
    return []


def _live_entry(state: Any, path: list[str]) -> Any:
    node = state
    for part in path:
        if isinstance(node, dict):
            node = node.get(part)
        elif isinstance(node, list | tuple) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def check_optimizer(
    name: str, sd: dict[str, Any], optimizer: Any, saved_shapes: dict[str, Any] | None
) -> None:
    """Raise StateMismatchError (one line: the entry and both shapes) when the checkpoint's
    optimizer state ``sd`` does not fit ``optimizer``. ``saved_shapes``: the parameter shapes
    recorded at save time (None for a checkpoint written before they were recorded)."""
    groups = sd.get("param_groups", [])
    if len(groups) != len(optimizer.param_groups):
        raise StateMismatchError(
            f"'{name}': checkpoint has {len(groups)} parameter groups, "
            f"the optimizer has {len(optimizer.param_groups)}"
        )
    params: dict[Any, torch.Tensor] = {}
    for i, (g_ck, g_now) in enumerate(zip(groups, optimizer.param_groups, strict=True)):
        if len(g_ck["params"]) != len(g_now["params"]):
            raise StateMismatchError(
                f"'{name}' group {i}: checkpoint has {len(g_ck['params'])} parameters, "
                f"the optimizer has {len(g_now['params'])}"
            )
        params.update(zip(g_ck["params"], g_now["params"], strict=True))
    saved = saved_shapes or {}
    for pid, p in params.items():
        was = saved.get(str(pid))
        if was is not None and list(was) != list(p.shape):
            raise StateMismatchError(
                f"{name}/param_groups: parameter {pid} has shape {_shape(was)} in the checkpoint, "
                f"{_shape(p.shape)} here"
            )
    live_state = getattr(optimizer, "state", {})
    for pid, state in sd.get("state", {}).items():
        param = params.get(pid)
        if param is None or not isinstance(state, dict):
            continue
        was = saved.get(str(pid))
        live = live_state.get(param, {}) if isinstance(live_state, dict) else {}
        for key, value in state.items():
            for path, t in _tensors(value, str(key)):
                now = _live_entry(live, path.split("/"))
                if isinstance(now, torch.Tensor):
                    if now.shape != t.shape:
                        raise StateMismatchError(
                            f"{name}/state/{pid}/{path}: checkpoint shape {_shape(t.shape)} does not "
                            f"match the optimizer's {_shape(now.shape)}"
                        )
                elif was is not None and list(t.shape) == list(was) and t.shape != param.shape:
                    # A per-element moment must fit the live parameter. (A checkpoint written
                    # before shapes were recorded is checked by its model entries alone.)
                    raise StateMismatchError(
                        f"{name}/state/{pid}/{path}: checkpoint shape {_shape(t.shape)} does not "
                        f"match the parameter's {_shape(param.shape)}"
                    )
