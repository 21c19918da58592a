"""A Lightning run with no smartckpt code: under ``smartckpt run`` the callback is added by itself.
A small MLP with dropout, AdamW with a per-step LR schedule, and a shuffled StatefulDataLoader
(torchdata) with a seeded generator, so Lightning keeps its position in its loop state.
Lightning's default ModelCheckpoint is on (``enable_checkpointing=True``): under smartckpt it must
write no ``.ckpt`` file.

Arguments: --out DIR (default_root_dir), --max-steps N (default 24: one epoch of 24 batches),
--kill-at K (SIGKILL itself at the end of step K on the first attempt), --step-time S (sleep per
step), --ready FILE (touched at the first step: a test may signal the process from then on),
--smartckpt DIR (add the callback explicitly, for runs outside ``smartckpt run``), --callback
(add ``SmartCheckpointCallback()`` with its settings from the environment, as the README shows),
--devices N (``strategy="ddp"`` on N CPU processes, which Lightning starts itself; rank
--kill-rank is the one killed), --plain-loader (a plain ``DataLoader`` without a generator:
Lightning gives it a ``DistributedSampler`` under ddp), --final PATH (each rank writes
PATH.r<rank>: its module's state_dict).
Output: ``loss STEP HEX`` per step, ``global_step N`` and ``done`` at the end.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torchdata.stateful_dataloader import StatefulDataLoader

try:
    import pytorch_lightning as pl
except ImportError:
    import lightning.pytorch as pl


class Model(pl.LightningModule):
    def __init__(self, total: int) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 1)
        )
        self.total = total

    def training_step(self, batch, batch_idx):
        x, y = batch
        x = x + 0.05 * torch.randn_like(x)  # the global torch RNG
        loss = F.mse_loss(self.net(x), y)
        print(f"loss {self.trainer.global_step + 1} {float(loss.detach()).hex()}", flush=True)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=3e-3)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=self.total)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Faults(pl.Callback):
    def __init__(self, kill_at: int | None, step_time: float, ready: str | None, kill_rank: int = 0) -> None:
        self.kill_at, self.step_time, self.ready, self.kill_rank = kill_at, step_time, ready, kill_rank

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.ready and not os.path.exists(self.ready):
            Path(self.ready).touch()
        if self.step_time:
            time.sleep(self.step_time)
        first = os.environ.get("SMARTCKPT_ATTEMPT", "0") == "0"
        if first and trainer.global_step == self.kill_at and trainer.global_rank == self.kill_rank:
            time.sleep(1.5)  # the save taken a few steps ago commits in the background meanwhile
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--max-steps", type=int, default=24)
    p.add_argument("--kill-at", type=int, default=None)
    p.add_argument("--step-time", type=float, default=0.0)
    p.add_argument("--ready", default=None)
    p.add_argument("--smartckpt", default=None, help="add SmartCheckpointCallback(DIR) explicitly")
    p.add_argument("--callback", action="store_true")
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--kill-rank", type=int, default=0)
    p.add_argument("--plain-loader", action="store_true")
    p.add_argument("--final", default=None)
    a = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    xs = torch.randn(96, 16, generator=g)
    ys = (xs @ torch.randn(16, 1, generator=g)).tanh()
    ds = torch.utils.data.TensorDataset(xs, ys)
    if a.plain_loader:
        loader = torch.utils.data.DataLoader(ds, batch_size=4, shuffle=True)
    else:
        loader = StatefulDataLoader(
            ds, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(2)
        )
    callbacks: list = [Faults(a.kill_at, a.step_time, a.ready, a.kill_rank)]
    if a.smartckpt or a.callback:
        from smartckpt_cli.integrations.lightning import SmartCheckpointCallback

        if a.smartckpt:
            callbacks.append(SmartCheckpointCallback(a.smartckpt, every_steps=5, keep_last=100))
        else:
            callbacks.append(SmartCheckpointCallback())
    trainer = pl.Trainer(
        max_steps=a.max_steps, default_root_dir=a.out, accelerator="cpu", devices=a.devices, logger=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        callbacks=callbacks, strategy="ddp" if a.devices > 1 else "auto",
    )  # fmt: skip
    model = Model(a.max_steps)
    trainer.fit(model, loader)
    if a.final:
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        torch.save(state, f"{a.final}.r{trainer.global_rank}")
    print(f"global_step {trainer.global_step}", flush=True)
    print("done", flush=True)


if __name__ == "__main__":
    main()
