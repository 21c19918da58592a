"""Where each rank's shard of a ``Shard(dim)`` tensor lies, at any world size (pure).

DTensor's ``Shard(dim)`` on a 1-D mesh splits a dimension the way ``torch.chunk`` does: every
rank gets ``ceil(n / world)`` rows, the last ones fewer and possibly none. A checkpoint records
each tensor's global shape and placement, so the rows an old rank held and the rows a new rank
needs are both known without asking anyone; restoring at another world size is then a matter of
copying the overlaps (:func:`pieces`). Placements are the strings the state tree stores:
``"S<dim>"`` for ``Shard(dim)``, ``"R"`` for ``Replicate``.
"""

from __future__ import annotations

from dataclasses import dataclass

from smartckpt_cli.errors import StateMismatchError

__all__ = ["Piece", "chunk_range", "pieces", "sharded_dim"]


def chunk_range(length: int, world: int, rank: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` of ``rank`` when ``length`` rows are split over ``world`` ranks, as
    ``torch.chunk`` and DTensor's ``Shard`` split them (uneven: the last ranks get fewer)."""
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} of a world of {world}")
    size = -(-length // world)
    start = min(length, size * rank)
    return start, min(length, start + size)


@dataclass(frozen=True)
class Piece:
    """Rows ``[src_start, src_stop)`` of old rank ``old_rank``'s shard go to rows starting at
    ``dst_start`` of the new shard."""

    old_rank: int
    src_start: int
    src_stop: int
    dst_start: int


def pieces(length: int, old_world: int, new_world: int, new_rank: int) -> list[Piece]:
    """What the new shard of ``new_rank`` is made of, in order: only the old shards that overlap
    it, and only their overlapping rows."""
    lo, hi = chunk_range(length, new_world, new_rank)
    out: list[Piece] = []
    for q in range(old_world):
        c, e = chunk_range(length, old_world, q)
        a, b = max(lo, c), min(hi, e)
        if a < b:
            out.append(Piece(q, a - c, b - c, a - lo))
    return out


def sharded_dim(key: str, placements: list[str]) -> int | None:
    """The sharded dimension of a 1-D placement (None when replicated). A 2-D mesh (tensor plus
    data parallel) or a ``Partial`` placement cannot be carried to another world size: refused
    in one line naming the entry."""
    if len(placements) != 1:
        raise StateMismatchError(
            f"{key}: saved on a {len(placements)}-D device mesh ({', '.join(placements)}); only 1-D "
            "meshes (FSDP2, DDP) restore at another world size"
        )
    (p,) = placements
    if p == "R":
        return None
    if p.startswith("S") and p[1:].isdigit():
        return int(p[1:])
    raise StateMismatchError(f"{key}: placement {p} cannot be restored at another world size")
