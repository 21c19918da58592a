"""Credentials never written, never printed: :func:`redact_url`, :func:`redact_argv`,
:func:`redact_text`.

The rule itself lives in ``hooks/_smartckpt_redact.py`` (standard library only): the child's
``sitecustomize`` needs it at interpreter start-up, before smartckpt may be importable, to keep
secrets out of ``hooks.<pid>.json``. Installed, that directory is the ``smartckpt_cli.hooks``
package (a package-dir mapping in pyproject.toml), which the layer checker cannot see in the source
tree; this leaf module hands the same functions to the rest of smartckpt, so every room can use
them without reaching into the hooks.
"""

from __future__ import annotations

from importlib import import_module

__all__ = ["MASK", "is_secret_name", "redact_argv", "redact_text", "redact_url"]

_rule = import_module("smartckpt_cli.hooks._smartckpt_redact")

MASK: str = _rule.MASK
is_secret_name = _rule.is_secret_name
redact_argv = _rule.redact_argv
redact_text = _rule.redact_text
redact_url = _rule.redact_url
