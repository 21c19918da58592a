"""The journal's line format: one JSON object per event with a ``crc`` field, the xxh3-64 of the
line's canonical JSON without that field. A line that does not parse or whose crc does not match
decodes to None. The same bytes are a line of ``journal.jsonl`` or the body of one journal
object (:mod:`.log`)."""

from __future__ import annotations

import json
from typing import Any

import xxhash

__all__ = ["decode_line", "encode_line"]


def _canonical(obj: dict[str, Any]) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False)


def encode_line(event: dict[str, Any]) -> bytes:
    body = {k: v for k, v in event.items() if k != "crc"}
    crc = xxhash.xxh3_64_hexdigest(_canonical(body).encode())
    return (_canonical({**body, "crc": crc}) + "\n").encode()


def decode_line(line: bytes) -> dict[str, Any] | None:
    try:
        obj = json.loads(line)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(obj, dict) or "crc" not in obj:
        return None
    crc = obj.pop("crc")
    if xxhash.xxh3_64_hexdigest(_canonical(obj).encode()) != crc:
        return None
    return obj
