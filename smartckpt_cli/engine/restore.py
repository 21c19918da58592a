"""Pick the newest committed checkpoint that verifies, and load it.

Selection is pure (:func:`candidates`, :func:`same_lineage`); :func:`load_checkpoint` reads and verifies one checkpoint
completely into memory (decoded bytes = the manifest's raw hash; a blob's own hash only names a
fault) before anything is loaded into the training objects, so a failure never leaves a half-restored model.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from smartckpt_cli.errors import CheckpointCorrupt
from smartckpt_cli.state import precision
from smartckpt_cli.state.apply import Loaded
from smartckpt_cli.state.dtypes import lookup
from smartckpt_cli.store import codec
from smartckpt_cli.store.blobs import BlobStore
from smartckpt_cli.store.checkpoints import candidates, read_manifest
from smartckpt_cli.store.journal import CheckpointRecord
from smartckpt_cli.store.storage.base import Storage

__all__ = [
    "Loaded",
    "candidates",
    "decode_entry",
    "decode_rows",
    "load_checkpoint",
    "read_manifest",
    "same_lineage",
    "warn_moments_reset",
]  # the two are re-exported

logger = logging.getLogger(__name__)


def same_lineage(order: list[Any]) -> list[Any]:
    """Pure: the candidates (each with a ``.record``, newest first) of the newest one's lineage.
    A run that began again at step 0 starts a lineage of its own (the commit line's ``lineage``;
    none on checkpoints written before lineages existed): a restore falls back to an earlier
    checkpoint of the same training, never into another one's."""
    if not order:
        return order
    first = order[0].record.event.get("lineage")
    return [c for c in order if c.record.event.get("lineage") == first]


def warn_moments_reset(loaded: Loaded) -> None:
    """Say it loudly when ``loaded`` comes without its optimizer moments (a corrupt L2 read with
    ``on_l2_corrupt="reset"``): the optimizer state starts over."""
    if "L2" in loaded.skipped_tiers:
        logger.warning(
            "OPTIMIZER MOMENTS OF STEP %d ARE CORRUPT: restoring weights and hyperparameters "
            "and re-initialising the optimizer state (on_l2_corrupt=reset)",
            loaded.record.step,
        )


def _read_stream(blobs: BlobStore, stream: dict[str, Any], out: np.ndarray, itemsize: int, key: str) -> None:
    pos = 0
    for bid, cod, raw_len, rh, _enc_len in stream["chunks"]:
        try:
            data = blobs.get(bid)
        except FileNotFoundError as err:
            raise ValueError(f"missing blob {bid}") from err
        part = out[pos : pos + raw_len]
        if part.size != raw_len:
            raise ValueError(f"chunks of {key} overrun its size")
        # The decoded bytes are checked against the raw hash, which is what restore needs; the
        # blob's own hash is computed only to name the fault when that check fails (one pass over
        # the encoded bytes saved on every healthy restore).
        try:
            decoded_hash: str | None = codec.decode_into(cod, data, part, itemsize)
            decode_error: Exception | None = None
        except Exception as err:  # a corrupt zstd frame raises its own error types
            decoded_hash, decode_error = None, err
        if decoded_hash != rh:
            if codec.blob_id(data) != bid:
                raise ValueError(f"hash mismatch in blob {bid}")
            if decode_error is not None:
                raise ValueError(f"undecodable chunk {bid}: {decode_error}") from decode_error
            raise ValueError(f"decoded chunk {bid} does not match its raw hash")
        pos += raw_len
    if pos != out.size:
        raise ValueError(f"chunks of {key} cover {pos} of {out.size} bytes")


def _decode_entry(blobs: BlobStore, key: str, entry: dict[str, Any]) -> torch.Tensor:
    dtype = lookup(entry["dtype"])
    stored_dtype = lookup(entry["stored_dtype"])
    shape = list(entry["shape"])
    stored = torch.empty(shape, dtype=stored_dtype)
    _read_stream(blobs, entry["data"], precision.byte_view(stored), stored.element_size(), key)
    idx = val = None
    if entry.get("patch"):
        n = int(entry["patch"]["n"])
        buf = torch.empty(n * 8 + n * torch.empty((), dtype=dtype).element_size(), dtype=torch.uint8)
        _read_stream(blobs, entry["patch"], buf.numpy(), 1, key)
        idx = buf[: n * 8].view(torch.int64)
        val = buf[n * 8 :].view(dtype)
    return precision.expand(stored, entry["transform"], dtype, idx, val)


def _encoded(entry: dict[str, Any]) -> int:
    return sum(
        int(c[4]) for stream in (entry["data"], entry.get("patch") or {}) for c in stream.get("chunks", [])
    )


def decode_entry(blobs: BlobStore, key: str, entry: dict[str, Any]) -> tuple[torch.Tensor, int]:
    """One entry, verified, and the encoded bytes read for it."""
    return _decode_entry(blobs, key, entry), _encoded(entry)


def decode_rows(
    blobs: BlobStore, key: str, entry: dict[str, Any], dim: int, start: int, stop: int
) -> tuple[torch.Tensor, int]:
    """Rows ``[start, stop)`` of dimension ``dim`` of an entry, verified, and the encoded bytes
    read. Rows of dimension 0 of an exactly stored entry are contiguous bytes: only the chunks
    holding them are read (each decoded whole, since a chunk's hash covers all of it); anything
    else is decoded whole and cut."""
    shape = list(entry["shape"])
    exact = entry["transform"].get("kind", "none") == "none" and not entry.get("patch")
    if dim != 0 or not exact or entry["stored_dtype"] != entry["dtype"]:
        whole, nbytes = decode_entry(blobs, key, entry)
        return whole.narrow(dim, start, stop - start), nbytes
    dtype = lookup(entry["dtype"])
    out = torch.empty([stop - start, *shape[1:]], dtype=dtype)
    row = out[0].numel() * out.element_size() if out.numel() else 0
    lo, hi = start * row, stop * row
    dest = precision.byte_view(out)
    pos = nbytes = 0
    for bid, cod, raw_len, rh, enc_len in entry["data"]["chunks"]:
        c_lo, c_hi = pos, pos + int(raw_len)
        pos = c_hi
        a, b = max(lo, c_lo), min(hi, c_hi)
        if a >= b:
            continue
        buf = np.empty(int(raw_len), dtype=np.uint8)
        _read_stream(blobs, {"chunks": [[bid, cod, raw_len, rh, enc_len]]}, buf, out.element_size(), key)
        dest[a - lo : b - lo] = buf[a - c_lo : b - c_lo]
        nbytes += int(enc_len)
    if pos < hi:
        raise ValueError(f"chunks of {key} cover {pos} bytes, rows up to {stop} need {hi}")
    return out, nbytes


def load_checkpoint(
    storage: Storage,
    blobs: BlobStore,
    record: CheckpointRecord,
    store_id: str | None,
    *,
    skip_corrupt_l2: bool = False,
    workers: int = 4,
    manifest: dict[str, Any] | None = None,
) -> Loaded:
    """Read and verify every stored entry. Raises CheckpointCorrupt naming the tier and the fault.
    With ``skip_corrupt_l2``, a corrupt L2 (optimizer moments) drops all of L2 instead of failing.
    ``manifest``: already read and verified (a multi-rank part with its refs resolved)."""
    if manifest is None:
        manifest = read_manifest(storage, record, store_id)
    entries: dict[str, Any] = manifest["entries"]

    def one(key: str) -> tuple[str, torch.Tensor | None, str | None]:
        try:
            return key, _decode_entry(blobs, key, entries[key]), None
        except (ValueError, KeyError, RuntimeError, OSError) as err:
            return key, None, str(err)

    with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="smartckpt-dec") as pool:
        results = list(pool.map(one, list(entries)))
    tensors: dict[str, torch.Tensor] = {}
    skipped: set[str] = set()
    for key, tensor, error in results:
        if error is None and tensor is not None:
            tensors[key] = tensor
            continue
        tier = entries[key]["tier"]
        if tier == "L2" and skip_corrupt_l2:
            skipped.add("L2")
            continue
        raise CheckpointCorrupt(f"step {record.step}: {tier} entry {key}: {error}", tier=tier)
    if "L2" in skipped:
        tensors = {k: t for k, t in tensors.items() if entries[k]["tier"] != "L2"}
    return Loaded(record, manifest, tensors, skipped)
