"""Zero-code mode and the integrations drive the manager through its public methods only
(issue 43): a private name of the manager used from outside the engine is a contract nobody wrote."""

from __future__ import annotations

import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "smartckpt_cli"


def test_no_private_name_of_the_manager_is_used_outside_the_engine():
    reach = re.compile(r"\b(?:mgr|manager|self\.mgr|self\._mgr|self\.manager)\._[a-z]\w*")
    found = []
    for folder in ("agent", "integrations"):
        for path in (PACKAGE / folder).rglob("*.py"):
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if reach.search(line):
                    found.append(f"{path.relative_to(PACKAGE)}:{n}: {line.strip()}")
    assert not found, "\n".join(found)
