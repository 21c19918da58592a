"""How much host memory a save may hold at once: the ``memory_budget`` setting, decided (pure).

A save holds, beyond training, its staging copy of the state (private buffers, or the RAM tier's
slot in shared memory, which *is* the staging buffer) and the encoder threads' scratch. Without a
budget that is one copy of the state (one RAM slot). With one (per rank):

* two copies fit: the RAM tier keeps a second slot (``ram_slots`` 0, the default, means "as the
  budget allows"), so a crash during a snapshot's copy still restores from RAM;
* one copy fits: one slot, as without a budget;
* not even one: the RAM tier stands down (its slot is a whole copy) and the save copies and
  writes the state in pieces of what the budget leaves, one piece at a time through one reusable
  buffer (engine/pager.py). The training loop waits for the copies (the optimizer step for the
  parameters and moments it updates, the save call for the rest): slower saves, never more memory.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StagingPlan", "encoder_reserve", "encoding_for", "plan_staging"]

MIN_CHUNK = 1 << 20  # below it a chunk's fixed costs (a file, an fsync, a hash call) dominate
SCRATCH_SHARE = 0.1  # of the state, the most the encoders' scratch may take where it can...
# ...but never less than this: below it the scratch is nothing next to the process, and fewer
# threads would only make a small state's save slower (its chunks written one after another)
SCRATCH_FLOOR = 32 << 20


@dataclass(frozen=True)
class StagingPlan:
    slots: int  # RAM slots the tier may take: 0 (a slot does not fit), 1 or 2
    piece: int | None  # bytes staged at once; None: the whole state at once
    line: str | None = None  # what the budget changes, said once (None: nothing)


def encoder_reserve(workers: int, chunk_bytes: int) -> int:
    """The encoder threads' scratch at most: per thread, a chunk's byte planes and shifted copy
    (two chunks, store/codec.py) and its compressed output (one)."""
    return 3 * workers * chunk_bytes


def encoding_for(state: int, *, chunk: int, workers: int) -> tuple[int, int]:
    """(chunk bytes, encoder threads) for a state of ``state`` bytes: the ``chunk_mb`` chunk and
    all the threads where their scratch (:func:`encoder_reserve`) is within a tenth of the state
    or 32 MiB, whichever is more (a 7B state: always); else the chunk halves, down to 1 MiB, then
    threads go, down to one. Depends on the state's size and the thread count only, so a resumed
    run cuts the same chunks (its blobs are shared with the run before)."""
    limit = max(state * SCRATCH_SHARE, SCRATCH_FLOOR)
    while chunk > MIN_CHUNK and encoder_reserve(workers, chunk) > limit:
        chunk = max(MIN_CHUNK, chunk // 2)
    while workers > 1 and encoder_reserve(workers, chunk) > limit:
        workers -= 1
    return chunk, workers


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def plan_staging(
    state: int, *, budget: int | None, reserve: int, chunk: int, ram: bool, slots: int
) -> StagingPlan:
    """``state``: bytes a save stages (every stored entry); ``budget``: the ``memory_budget``
    setting in bytes (None: unbounded); ``reserve``: the encoders' scratch; ``chunk``: the
    chunk size (a piece holds one at least: the unit a tensor is cut at); ``ram``: whether the
    RAM tier is on; ``slots``: the ``ram_slots`` setting (0: as the budget allows)."""
    if budget is None:
        return StagingPlan(slots or 1, None)
    room = budget - reserve
    if state <= room:
        fit = 2 if 2 * state <= room else 1
        want = slots or fit
        if want > fit and ram:
            return StagingPlan(
                1,
                None,
                f"ram_slots 2 needs {_gb(2 * state)} for two RAM slots, above memory_budget "
                f"({_gb(budget)}, {_gb(reserve)} of it the encoders'): one slot",
            )
        return StagingPlan(want, None)
    piece = max(chunk, room)
    ram_part = (
        ", and the RAM tier stands down (a slot is a whole copy: restarts restore from disk)" if ram else ""
    )
    return StagingPlan(
        0,
        piece,
        f"the state to save ({_gb(state)}) is above memory_budget ({_gb(budget)}, {_gb(reserve)} of it "
        f"the encoders'): each save copies and writes it in pieces of {_gb(piece)}, the training loop "
        f"waiting until the last piece is copied (slower saves, never more memory){ram_part}",
    )
