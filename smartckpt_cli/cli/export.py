"""``smartckpt export``: a checkpoint as a standard torch or safetensors file."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from smartckpt_cli.cli._shared import DirArg, MetaDirOpt, human, say

__all__ = ["Format", "export"]


class Format(str, Enum):
    torch = "torch"
    safetensors = "safetensors"


def export(
    directory: DirArg,
    out: Annotated[Path, typer.Argument(help="File to write.", show_default=False)],
    step: Annotated[int | None, typer.Option("--step", help="Step to export (default: newest live).")] = None,
    fmt: Annotated[Format, typer.Option("--format", help="File format.")] = Format.torch,
    weights_only: Annotated[
        bool, typer.Option("--weights-only", help="Only the models' state_dicts (no optimizer, RNG...).")
    ] = False,
    force: Annotated[bool, typer.Option("--force", help="Replace OUT if it exists.")] = False,
    meta_dir: MetaDirOpt = None,
) -> None:
    """Write a checkpoint as a torch or safetensors file that loads without smartckpt.

    The file loads with torch.load(weights_only=True) or safetensors; the checkpoint is verified
    while it is read.

    With --weights-only and one model, the file holds that model's state_dict itself; otherwise
    a dict {object name: state_dict} (plus 'smartckpt': step and id, for torch).

    A checkpoint written by several ranks (torchrun, FSDP2) becomes one file: each sharded tensor
    whole, assembled from every rank's part, for an unsharded model.

    \b
    Examples:
      smartckpt export ./checkpoints model.pt --weights-only
        then: model.load_state_dict(torch.load("model.pt", weights_only=True))
      smartckpt export ./checkpoints step1200.safetensors --step 1200 \\
        --format safetensors

    \b
    Exit codes:
      0  written
      1  the checkpoint is corrupt or the store has none
      2  bad input: not a store, no such step, OUT exists, safetensors not
         installed, a multi-rank layout that cannot be consolidated (2-D mesh)
    """
    from smartckpt_cli.ops.export import export as run_export
    from smartckpt_cli.store.directory import open_store

    store = open_store(directory, meta_dir)
    result = run_export(store, out, step=step, fmt=fmt.value, weights_only=weights_only, force=force)
    say(
        f"exported step {result.step} ({result.id}) to {result.path}: {result.format}, "
        f"{', '.join(result.objects)}; {result.tensors} tensors, {human(result.bytes)}"
        + (f"; consolidated from {result.world_size} ranks" if result.world_size > 1 else "")
    )
    if result.not_stored:
        say(
            f"not stored in the checkpoint (L4), exported as None: {', '.join(result.not_stored)}", error=True
        )
