"""The shape of a manifest, checked once where it is decoded (``journal.decode_manifest``), so that
no reader — restore, verify, inspect, export, the remote tier — meets a value of the wrong type
deep inside its own code. Pure, no I/O.

A manifest's hash is named by its commit line, and a commit line's crc is public: a manifest
that verifies may still have been written by someone else. Its blob ids are names (checked by
:func:`~smartckpt_cli.store.names.check_manifest_chunks`); everything else must have the types
smartckpt writes, or the checkpoint is damaged (``ValueError``, one line naming the file and the
field).
"""

from __future__ import annotations

from typing import Any

from smartckpt_cli.store.names import check_manifest_chunks, shown

__all__ = ["check_manifest"]

_CHUNK_TYPES = (str, str, int, str, int)  # blob id, codec, raw length, raw hash, encoded length


def _bad(where: str, field: str, value: Any, what: str) -> ValueError:
    return ValueError(f"{where}: {field} {shown(value)} is not {what}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_entry(key: str, entry: dict[str, Any], where: str) -> None:
    name = f"entry {shown(key)}"
    if "ref" in entry:  # a multi-rank part: stored once, in a lower rank's part (names.py checks the rank)
        if not isinstance(entry.get("tier"), str):
            raise _bad(where, f"{name} tier", entry.get("tier"), "a tier")
        return
    for field in ("tier", "dtype", "stored_dtype"):
        if not isinstance(entry.get(field), str):
            raise _bad(where, f"{name} {field}", entry.get(field), "a string")
    shape = entry.get("shape")
    if not isinstance(shape, list) or not all(_is_int(n) and n >= 0 for n in shape):
        raise _bad(where, f"{name} shape", shape, "a list of sizes")
    transform = entry.get("transform", {})
    if not isinstance(transform, dict) or not isinstance(transform.get("kind", "none"), str):
        raise _bad(where, f"{name} transform", transform, "a transform")
    for stream_name in ("data", "patch"):
        stream = entry.get(stream_name)
        if stream is None and stream_name == "patch":
            continue
        if not isinstance(stream, dict) or not isinstance(stream.get("chunks"), list):
            raise _bad(where, f"{name} {stream_name}", stream, "a stream with a chunk list")
        if stream_name == "patch" and not (_is_int(stream.get("n")) and stream["n"] >= 0):
            raise _bad(where, f"{name} patch n", stream.get("n"), "a count")
        for n, chunk in enumerate(stream["chunks"]):
            if (
                not isinstance(chunk, list)
                or len(chunk) != len(_CHUNK_TYPES)
                or not all(
                    _is_int(v) and v >= 0 if t is int else isinstance(v, t)
                    for v, t in zip(chunk, _CHUNK_TYPES, strict=True)
                )
            ):
                raise _bad(
                    where, f"{name} {stream_name} chunk {n}", chunk, "[blob id, codec, size, hash, size]"
                )


def check_manifest(obj: dict[str, Any], where: str) -> None:
    """Raise ValueError (one line: file, field, value) unless ``obj`` has the shape of a manifest
    smartckpt writes and every blob id in it is a blob id."""
    entries = obj.get("entries")
    if not isinstance(entries, dict):
        raise _bad(where, "entries", entries, "a mapping")
    for key, entry in entries.items():
        if not isinstance(entry, dict):
            raise _bad(where, f"entry {shown(key)}", entry, "a mapping")
        _check_entry(key, entry, where)
    check_manifest_chunks(obj, where)
    for field in ("meta", "objects"):
        if not isinstance(obj.get(field, {}), dict):
            raise _bad(where, field, obj.get(field), "a mapping")
    for name, spec in obj.get("objects", {}).items():
        if not isinstance(spec, dict) or not isinstance(spec.get("kind", ""), str):
            raise _bad(where, f"object {shown(name)}", spec, "an object (kind and tree)")
    not_stored = obj.get("not_stored", [])
    if not isinstance(not_stored, list) or not all(isinstance(k, str) for k in not_stored):
        raise _bad(where, "not_stored", not_stored, "a list of keys")
    for field, kind in (("step", int), ("id", str), ("store_id", str), ("health", str)):
        if field in obj and not (_is_int(obj[field]) if kind is int else isinstance(obj[field], kind)):
            raise _bad(where, field, obj[field], "an integer" if kind is int else "a string")
