"""Does a save cost what changed? A LoRA-shaped model against its adapters alone.

The model: a frozen base of ``--layers`` linear layers of ``--width`` (with their biases) and, on
each, two trained low-rank adapters (rank ``--rank``); AdamW over the adapters only. So about
91 % of the state's bytes are frozen (the issue's shape). Two managers in one process,
interleaved save by save (this machine is shared: compare within one process): one registered
with the whole model, one with only the adapters (what an ideal save would cost). For each save
after ``--warmup`` ones: the bytes it copied (``SaveHandle.bytes_copied``: staged, hashed), what
the save call blocked the loop (``blocking_seconds``: an eager ``save()``, every copy on the
caller), the background persist (``CommitInfo.seconds``). Medians are reported, and the ratio
whole model / adapters alone.

    python benchmarks/save_what_changed.py [--width 1024] [--layers 8] [--rank 8] [--saves 12] [--json PATH]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `python benchmarks/save_what_changed.py` from a checkout
    sys.path.insert(0, str(ROOT))

import _record  # noqa: E402
import torch  # noqa: E402

import smartckpt_cli as sc  # noqa: E402


class Adapted(torch.nn.Module):
    def __init__(self, width: int, layers: int, rank: int) -> None:
        super().__init__()
        self.base = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(layers))
        self.down = torch.nn.ModuleList(torch.nn.Linear(width, rank, bias=False) for _ in range(layers))
        self.up = torch.nn.ModuleList(torch.nn.Linear(rank, width, bias=False) for _ in range(layers))
        for p in self.base.parameters():
            p.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b, d, u in zip(self.base, self.down, self.up, strict=True):
            x = torch.tanh(b(x) + u(d(x)))
        return x


class Adapters(torch.nn.Module):
    """The adapters of an :class:`Adapted`, as a module of their own (the ideal save's state)."""

    def __init__(self, model: Adapted) -> None:
        super().__init__()
        self.down, self.up = model.down, model.up


def _copied(handle: object) -> int:
    got = getattr(handle, "bytes_copied", None)
    if got is not None:
        return int(got)
    snap = handle._snapshot  # type: ignore[attr-defined]  # before SaveHandle.bytes_copied
    return sum(i.tensor.numel() * i.tensor.element_size() for i in snap.items if i.tensor is not None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--saves", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    _record.add_json_argument(p, "save_what_changed")
    a = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Adapted(a.width, a.layers, a.rank)
    opt = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=1e-3)
    state = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    frozen = sum(q.numel() * q.element_size() for q in model.base.parameters())
    rows: dict[str, list[dict[str, float]]] = {"whole model": [], "adapters alone": []}
    with tempfile.TemporaryDirectory() as d:
        whole = sc.CheckpointManager(Path(d) / "whole", keep_last=2)
        whole.register(model=model, optimizer=opt)
        alone = sc.CheckpointManager(Path(d) / "alone", keep_last=2)
        alone.register(model=Adapters(model), optimizer=opt)
        x = torch.randn(16, a.width)
        for step in range(1, a.saves + 1):
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            for name, mgr in (("whole model", whole), ("adapters alone", alone)):
                h = mgr.save(step)
                info = h.wait()
                if step > a.warmup and info is not None:
                    rows[name].append(
                        {"copied": _copied(h), "blocking": h.blocking_seconds, "persist": info.seconds}
                    )
        whole.close()
        alone.close()
    rec = _record.start("save_what_changed")
    med = {
        n: {k: statistics.median(r[k] for r in rs) for k in ("copied", "blocking", "persist")}
        for n, rs in rows.items()
    }
    for n, m in med.items():
        tag = n.replace(" ", "_")
        rec.add(f"{tag}_bytes_copied", m["copied"], "B", f"{n}: bytes a save copies and hashes (median)")
        rec.add(f"{tag}_save_call", m["blocking"], "s", f"{n}: what the save call blocked (median)")
        rec.add(f"{tag}_persist", m["persist"], "s", f"{n}: the background persist (median)")
    w, o = med["whole model"], med["adapters alone"]
    rec.add(
        "copied_ratio", w["copied"] / max(1.0, o["copied"]), "x", "bytes copied, whole model / adapters alone"
    )
    rec.add(
        "save_call_ratio",
        w["blocking"] / max(1e-9, o["blocking"]),
        "x",
        "save call, whole model / adapters alone",
    )
    rec.details.update(state_bytes=state, frozen_bytes=frozen, rows=rows, args=vars(a))
    rec.write(a.json)
    print(f"state {state / 2**20:.1f} MiB, frozen {frozen / 2**20:.1f} MiB ({100 * frozen / state:.0f} %)")
    for n, m in med.items():
        print(
            f"{n:>15}: copies {m['copied'] / 2**20:7.2f} MiB, save call {1e3 * m['blocking']:6.1f} ms, persist {1e3 * m['persist']:6.1f} ms"
        )
    print(
        f"ratios whole / alone: copied {w['copied'] / max(1.0, o['copied']):.2f}x, save call {w['blocking'] / max(1e-9, o['blocking']):.2f}x"
    )


if __name__ == "__main__":
    main()
