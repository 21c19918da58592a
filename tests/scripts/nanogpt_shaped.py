"""A training script shaped like nanoGPT's ``train.py`` (written here, no code taken from it), for
the tests of ``smartckpt run`` on loops smartckpt did not shape (``tests/test_your_loop.py``).

Its loop is nanoGPT's: ``while True`` with its own counter ``iter_num``; the learning rate set by
hand at the top of each iteration; every ``--eval-interval`` iterations an evaluation under
``torch.no_grad()`` that draws its batches from the same global RNG, and a ``torch.save`` of its
own ``ckpt.pt``; gradient accumulation whose micro-steps fetch the *next* batch before
``backward()``, so the batch of iteration N+1 is drawn before the optimizer step of iteration N
(the prefetch); a GradScaler (CPU) whose scale grows every few steps; dropout; gradient clipping.

Flags (the smartckpt lines are off by default: the script as a user has it):
  --start-step       ``iter_num = smartckpt_cli.start_step()`` right before the loop
  --carry            also ``X, Y, best_val_loss = smartckpt_cli.carry(...)`` at the top of the
                     loop body (the README's change for a batch prefetched across the step)
  --early-start-step call ``start_step()`` before the model exists (a mistake)
  --max-iters N      the loop ends once ``iter_num > N`` (nanoGPT's test, at the bottom)
  --kill-at N        SIGKILL itself after iteration N, on the first attempt only
  --sleep S          seconds per iteration (default 0.02)
  --out PATH         at the end, torch.save model, optimizer, scaler, best_val_loss and RNG

Output: ``iter N loss HEX`` per iteration (the step's loss, float.hex), ``eval N HEX`` per
evaluation, ``done N`` at the end.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import time

import torch
import torch.nn.functional as F

import smartckpt_cli

VOCAB, BLOCK, BATCH, GAS = 32, 16, 4, 2


class TinyLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, 24)
        self.pos = torch.nn.Parameter(torch.zeros(BLOCK, 24))
        self.mix = torch.nn.Linear(24, 24)
        self.drop = torch.nn.Dropout(0.1)
        self.head = torch.nn.Linear(24, VOCAB)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.drop(torch.tanh(self.mix(self.emb(x) + self.pos)))
        logits = self.head(h)
        return logits, F.cross_entropy(logits.view(-1, VOCAB), y.view(-1))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--start-step", action="store_true")
    p.add_argument("--carry", action="store_true")
    p.add_argument("--early-start-step", action="store_true")
    p.add_argument("--max-iters", type=int, default=40)
    p.add_argument("--eval-interval", type=int, default=10)
    p.add_argument("--kill-at", type=int, default=None)
    p.add_argument("--sleep", type=float, default=0.02)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    first_attempt = os.environ.get("SMARTCKPT_ATTEMPT", "0") == "0"

    torch.set_num_threads(1)
    torch.manual_seed(1337)
    g = torch.Generator().manual_seed(7)
    data = {
        "train": torch.randint(VOCAB, (4000,), generator=g),
        "val": torch.randint(VOCAB, (800,), generator=g),
    }

    def get_batch(split: str) -> tuple[torch.Tensor, torch.Tensor]:
        d = data[split]
        ix = torch.randint(len(d) - BLOCK, (BATCH,))  # the global RNG, as nanoGPT's
        x = torch.stack([d[i : i + BLOCK] for i in ix])
        y = torch.stack([d[i + 1 : i + 1 + BLOCK] for i in ix])
        return x, y

    iter_num = 0
    best_val_loss = 1e9
    if args.early_start_step:
        iter_num = smartckpt_cli.start_step()  # too early: nothing exists to restore into
    model = TinyLM()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)

    @torch.no_grad()
    def estimate_loss() -> dict[str, float]:
        out = {}
        model.eval()
        for split in ("train", "val"):
            losses = torch.zeros(3)
            for k in range(3):
                x, y = get_batch(split)
                losses[k] = model(x, y)[1].item()
            out[split] = float(losses.mean())
        model.train()
        return out

    def get_lr(it: int) -> float:
        if it < 5:
            return 1e-3 * (it + 1) / 6
        return 1e-4 + 0.5 * (1.0 + math.cos(math.pi * min(1.0, it / 60))) * 9e-4

    X, Y = get_batch("train")  # fetch the very first batch
    if args.start_step or args.carry:
        iter_num = smartckpt_cli.start_step()
    while True:
        if args.carry:
            X, Y, best_val_loss = smartckpt_cli.carry(X=X, Y=Y, best_val_loss=best_val_loss)
        lr = get_lr(iter_num)
        for group in optimizer.param_groups:
            group["lr"] = lr
        if iter_num % args.eval_interval == 0:
            losses = estimate_loss()
            print(f"eval {iter_num} {losses['val'].hex()}", flush=True)
            if losses["val"] < best_val_loss:
                best_val_loss = losses["val"]
                if iter_num > 0:
                    torch.save({"model": model.state_dict(), "iter_num": iter_num}, "ckpt.pt")
        for _micro in range(GAS):
            _logits, loss = model(X, Y)
            loss = loss / GAS
            X, Y = get_batch("train")  # the prefetch: before backward, before the optimizer step
            scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        print(f"iter {iter_num} loss {(loss.item() * GAS).hex()}", flush=True)
        time.sleep(args.sleep)
        if args.kill_at is not None and iter_num == args.kill_at and first_attempt:
            time.sleep(1.0)  # the save taken a few steps ago commits meanwhile
            os.kill(os.getpid(), signal.SIGKILL)
        iter_num += 1
        if iter_num > args.max_iters:
            break
    print(f"done {iter_num}", flush=True)
    if args.out:
        torch.save(
            {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scaler": scaler.state_dict(),
                "best_val_loss": best_val_loss,
                "rng": torch.get_rng_state(),
            },
            args.out,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
