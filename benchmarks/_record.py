"""The result file of a script in ``benchmarks/``: its ``--json`` option (default
``benchmarks/results/<name>.json``) and a :class:`~smartckpt_cli.bench.record.Record` that
knows the command line, the commit, the device and the machine. Format: docs/benchmarks.md.

    rec = _record.start("throughput", args.json, device)   # device: a torch.device, or None
    rec.add("ratio", 0.98, "x", "training throughput with checkpointing / without")
    rec.details["pairs"] = [...]
    rec.write(args.json)

Imports torch only when the caller already has (a benchmark without tensors stays without).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
if importlib.util.find_spec("smartckpt_cli") is None and str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from smartckpt_cli.bench.record import Record, machine, script_command  # noqa: E402

__all__ = ["RESULTS", "add_json_argument", "device_info", "start"]


def add_json_argument(p: argparse.ArgumentParser, name: str) -> None:
    """``--json PATH``, default ``benchmarks/results/<name>.json`` (a committed result file)."""
    p.add_argument(
        "--json",
        default=str(RESULTS / f"{name}.json"),
        help=f"the result file (default: benchmarks/results/{name}.json)",
    )


def device_info(device: Any = None) -> dict[str, Any]:
    """``{"type", "name"}`` of a torch device (None: the CPU)."""
    kind = getattr(device, "type", device) or "cpu"
    if kind == "cuda":
        import torch

        return {"type": "cuda", "name": torch.cuda.get_device_name(device)}
    return {"type": str(kind), "name": machine()["cpu_model"]}


def start(name: str, device: Any = None, script: str | None = None) -> Record:
    """The record of this run of ``benchmarks/<name>.py`` (the command line from ``sys.argv``)."""
    torch = sys.modules.get("torch")
    path = script or str(ROOT / "benchmarks" / f"{name}.py")
    return Record(
        name,
        script_command(path),
        device=device_info(device),
        torch=getattr(torch, "__version__", None),
        where=path,
    )
