"""What a save need not copy: state entries proven unchanged since the last committed checkpoint.

A LoRA fine-tune of a 13B model keeps a 26 GB frozen base and trains a few hundred MB of
adapters; copying (device to host), hashing and looking up the base at every save costs seconds
and memory for bytes that never change. An entry whose tensor is provably the same as at the last
committed checkpoint is *referenced* instead: its manifest entry (blob ids, hashes) is that
checkpoint's, and the save neither copies nor hashes it.

Proof. A tensor's *fingerprint* is its storage (address, offset, shape, strides, dtype, device)
and its in-place version counter: every in-place write through the tensor or a view of it bumps
the counter (an optimizer step, ``copy_``, ``add_``). Equal fingerprints at two saves mean no
such write happened in between, provided the storage is the same one: an address is reused once
its storage is freed (a ``state_dict`` that returns a fresh tensor each time, as the RNG's does,
would look unchanged). So the storage of every fingerprint kept is held (:class:`Held`): while
held it cannot be freed, and the same address is the same storage. Three writes do not bump it: through ``.data`` (a tensor sharing
the storage but not the counter), through a NumPy view, and by an external kernel. So:

* **groups**: the entries of one submodule (``encoder.layer.3.norm.``) are unchanged only
  together: BatchNorm's kernel updates its running statistics without bumping their counters,
  but it bumps ``num_batches_tracked`` beside them;
* **rotation**: every save re-hashes a share of the referenced entries' chunks (round robin,
  ``rotation`` saves for all of them: each save 1/``rotation`` of the chunks, the bytes read
  where they are on the CPU, a slice copied off a GPU) in the background, against the raw hash
  the referenced entry holds. An entry changed behind its counter is caught within ``rotation``
  saves, said in one line, copied at the next save and every save after (:meth:`Unchanged.changed`).

With the RAM tier the slot a snapshot is copied into must hold the entry too: an entry is
referenced only where that slot was last filled with the same fingerprint (the two slots
alternate, so a frozen tensor is copied twice, then never).

Threads: :meth:`decide` runs on the training thread (in the snapshot); :meth:`committed`,
:meth:`ram_committed` and :meth:`changed` on the save thread. The maps they share are behind one
lock.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["Decision", "Fingerprint", "Held", "Unchanged", "fingerprint", "group_of"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Held:
    """A fingerprint and the storage it was taken of, held so its address is not reused."""

    fp: tuple[Any, ...]
    storage: Any = field(compare=False, repr=False)


Fingerprint = Held


def fingerprint(t: torch.Tensor) -> Held:
    """Storage identity and the in-place version counter of ``t`` (module docstring)."""
    storage = t.untyped_storage()
    fp = (
        storage.data_ptr(),
        t.storage_offset(),
        tuple(t.shape),
        tuple(t.stride()),
        t.dtype,
        str(t.device),
        t._version,
    )
    return Held(fp, storage)


def group_of(key: str, kind: str) -> str:
    """The entries unchanged only together: a module's entries by their submodule
    (``model/encoder.norm.running_mean`` -> ``model/encoder.norm``); any other entry alone."""
    if kind != "module":
        return key
    return key.rsplit(".", 1)[0] if "." in key.split("/", 1)[-1] else key


@dataclass(frozen=True)
class Decision:
    """What :meth:`Unchanged.decide` decided for one snapshot."""

    refs: dict[str, dict[str, Any]]  # key -> the committed entry it is referenced as
    # the rotation's share: (key, first byte, length, the raw hash those bytes must have)
    verify: list[tuple[str, int, int, str]]
    fps: dict[str, Fingerprint]  # every tensor's fingerprint, for committed()/ram_committed()


@dataclass
class _Known:
    fp: Fingerprint
    entry: dict[str, Any]  # its manifest entry in the last committed checkpoint


class Unchanged:
    """The fingerprints of the last committed checkpoint and of each RAM slot (module docstring).
    ``rotation``: saves within which every referenced entry is staged and hashed again."""

    def __init__(self, rotation: int = 8) -> None:
        self.rotation = max(1, rotation)
        self._lock = threading.Lock()
        self._known: dict[str, _Known] = {}  # key -> as committed
        # (RAM slot, its layout) -> key -> the fingerprint copied there: a new layout knows nothing
        self._slots: dict[Any, dict[str, Fingerprint]] = {}
        self._unreliable: set[str] = set()  # changed behind their counter once: always staged
        self._turn = 0  # where the rotation goes on

    def decide(
        self,
        tensors: dict[str, tuple[str, torch.Tensor]],
        plans: dict[str, Any],
        slot: Any,
        *,
        ram_only: bool = False,
    ) -> Decision:
        """Training thread: which entries of this snapshot are referenced, which are staged again
        by the rotation (to be compared), and every tensor's fingerprint. ``tensors``: key ->
        (kind, tensor); ``plans``: key -> its EntryPlan (a referenced entry keeps its tier and
        precision); ``slot``: the RAM slot it is copied into with its layout (any key the RAM
        tier gives it), or None; ``ram_only``: a RAM
        snapshot alone (no disk entry needed: the slot decides)."""
        fps = {key: fingerprint(t) for key, (_, t) in tensors.items()}
        with self._lock:
            held = self._slots.get(slot, {}) if slot is not None else {}
            same: dict[str, bool] = {}
            for key, fp in fps.items():
                known = self._known.get(key)
                on_disk = ram_only or (
                    known is not None
                    and known.fp == fp
                    and "data" in known.entry
                    and known.entry.get("tier") == plans[key].tier
                    and (known.entry.get("transform") or {}).get("kind", "none") == plans[key].transform
                )
                in_slot = slot is None or held.get(key) == fp
                same[key] = on_disk and in_slot and key not in self._unreliable
            groups: dict[str, bool] = {}
            for key, (kind, _) in tensors.items():
                g = group_of(key, kind)
                groups[g] = groups.get(g, True) and same[key]
            refs = {
                key: (self._known[key].entry if key in self._known else {})
                for key, (kind, _) in tensors.items()
                if groups[group_of(key, kind)]
            }
            verify = [] if ram_only else self._rotate(refs)
        return Decision(refs, verify, fps)

    def _rotate(self, refs: dict[str, dict[str, Any]]) -> list[tuple[str, int, int, str]]:
        """This save's share of the referenced entries' chunks, round robin: 1/rotation of them
        (at least one), so every chunk is read again within ``rotation`` saves."""
        chunks = [
            (key, start, int(c[2]), str(c[3]))
            for key in sorted(refs)
            for start, c in _offsets(refs[key].get("data", {}).get("chunks", []))
        ]
        if not chunks:
            return []
        n = -(-len(chunks) // self.rotation)
        start = self._turn % len(chunks)
        self._turn = start + n
        return [chunks[(start + i) % len(chunks)] for i in range(n)]

    def committed(self, fps: dict[str, Fingerprint], entries: dict[str, dict[str, Any]]) -> None:
        """Save thread: a checkpoint committed with ``entries`` (its manifest's, this rank's
        part) from tensors of fingerprints ``fps``."""
        with self._lock:
            self._known = {k: _Known(fps[k], e) for k, e in entries.items() if k in fps}

    def ram_committed(self, slot: Any, fps: dict[str, Fingerprint], staged: set[str]) -> None:
        """Save thread: RAM slot ``slot`` now holds the entries ``staged`` (copied this time)
        and keeps the others it held (referenced: unchanged)."""
        with self._lock:
            held = self._slots.get(slot, {})
            self._slots[slot] = {k: fp for k, fp in fps.items() if k in staged or held.get(k) == fp}

    def forget(self, key: str) -> None:
        """Save thread: ``key`` is copied by the next save (its blob was found damaged)."""
        with self._lock:
            self._known.pop(key, None)

    def changed(self, key: str, step: int) -> None:
        """Save thread: the rotation read bytes of ``key`` that differ from the entry it was
        referenced as: written behind its version counter. Said once; copied at every save from
        the next one on."""
        with self._lock:
            first = key not in self._unreliable
            self._unreliable.add(key)
        if first:
            logger.warning(
                "smartckpt: %s changed without its version counter moving (written through .data, a "
                "NumPy view or an external kernel), seen at step %d: copied at every save from the next on",
                key,
                step,
            )


def _offsets(chunks: list[Any]) -> list[tuple[int, Any]]:
    """Each chunk of an entry's stream with the offset of its first raw byte."""
    out, pos = [], 0
    for c in chunks:
        out.append((pos, c))
        pos += int(c[2])
    return out
