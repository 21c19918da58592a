"""Reading a child's lines out of output that the supervisor shares."""

from __future__ import annotations


def child_lines(text: str) -> list[str]:
    """The lines of ``text`` with any supervisor line that landed inside one cut off.

    The children print unbuffered (PYTHONUNBUFFERED): print() writes its text and its newline
    apart, so a ``smartckpt:`` line written to the same stream can land between them
    ("step 11 loss 0x1.d7p+1smartckpt: attempt 1: resumed ..."); the child's part is what
    comes before it.
    """
    return [ln.split("smartckpt:", 1)[0] for ln in text.splitlines()]
