"""An LSTM language model whose hidden state runs from batch to batch within an epoch (the shape of
pytorch/examples' word_language_model, written here): the token stream is cut into ``BSZ``
columns by hand, each step trains on the next ``BPTT`` rows and hands its final hidden state to
the next step (detached); the hidden state starts afresh at each epoch. Epochs x batches with
hand-made batching, a state carried across steps, dropout from the global RNG.

Flags:
  --carry        ``hidden = smartckpt_cli.carry(hidden=hidden)`` at the top of the inner loop (the
                 README's change for a hidden state carried across steps)
  --epochs N     (default 4); each epoch has ``NB`` = 7 steps
  --kill-at N    SIGKILL itself after step N (1-based), on the first attempt only
  --out PATH     at the end, torch.save the model, optimizer and RNG state

The loop begins at ``smartckpt_cli.start_step()`` (epoch and batch from it).
Output: ``step N loss HEX`` per step, ``done`` at the end.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

import torch
import torch.nn.functional as F

import smartckpt_cli

VOCAB, BSZ, BPTT, NB = 40, 4, 8, 7


class RNNModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, 16)
        self.rnn = torch.nn.LSTM(16, 32)
        self.drop = torch.nn.Dropout(0.2)
        self.out = torch.nn.Linear(32, VOCAB)

    def forward(
        self, x: torch.Tensor, hidden: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, tuple]:
        h, hidden = self.rnn(self.drop(self.emb(x)), hidden)
        return self.out(self.drop(h)), hidden

    def init_hidden(self) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros(1, BSZ, 32), torch.zeros(1, BSZ, 32)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--carry", action="store_true")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--kill-at", type=int, default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    first_attempt = os.environ.get("SMARTCKPT_ATTEMPT", "0") == "0"

    torch.set_num_threads(1)
    torch.manual_seed(0)
    stream = torch.randint(VOCAB, (BSZ * (NB * BPTT + 1),), generator=torch.Generator().manual_seed(3))
    source = stream.view(BSZ, -1).t().contiguous()  # batchify: one column per sequence
    model = RNNModel()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)

    start = smartckpt_cli.start_step()
    epoch0, batch0 = divmod(start, NB)
    step = start
    for _epoch in range(epoch0, args.epochs):
        hidden = model.init_hidden()
        for b in range(batch0, NB):
            if args.carry:
                hidden = smartckpt_cli.carry(hidden=hidden)
            x, y = source[b * BPTT : (b + 1) * BPTT], source[b * BPTT + 1 : (b + 1) * BPTT + 1]
            hidden = tuple(h.detach() for h in hidden)
            opt.zero_grad()
            logits, hidden = model(x, hidden)
            loss = F.cross_entropy(logits.view(-1, VOCAB), y.reshape(-1))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            step += 1
            print(f"step {step} loss {loss.item().hex()}", flush=True)
            time.sleep(0.02)
            if step == args.kill_at and first_attempt:
                time.sleep(1.0)  # the save taken a few steps ago commits meanwhile
                os.kill(os.getpid(), signal.SIGKILL)
        batch0 = 0
    print("done", flush=True)
    if args.out:
        torch.save(
            {"model": model.state_dict(), "optimizer": opt.state_dict(), "rng": torch.get_rng_state()},
            args.out,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
