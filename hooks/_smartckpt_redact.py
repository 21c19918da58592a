"""What must never be written or printed: credentials in URLs and in command lines.

Standard library only, and the one home of the rule: the child's ``sitecustomize`` imports it
(its ``hooks.<pid>.json`` records the command line) long before smartckpt itself may be
importable, and the rest of smartckpt imports it as ``smartckpt_cli.hooks._smartckpt_redact``
(``remote.backend.display_url``, the run record, the status line).

- :func:`redact_url` removes the userinfo of any scheme (``s3://KEY:SECRET@bucket/prefix``) —
  also when the secret holds ``/``, ``?`` or ``#``, where ``urllib.parse.urlsplit`` would end the
  host early and miss it — and the values of query parameters that carry credentials
  (``X-Amz-Signature``, ``X-Amz-Credential``, ``sig``, ``token``, ``key``...).
- :func:`redact_argv` replaces the values of options whose names say they hold a secret
  (``--hf-token=...``, ``--api-key X``, ``PASSWORD=...``), and redacts every URL argument.
"""

from __future__ import annotations

import re

__all__ = ["MASK", "is_secret_name", "redact_argv", "redact_text", "redact_url"]

MASK = "***"

# Names of options, variables and query parameters whose values are credentials. Substrings, any
# case: "X-Amz-Security-Token", "--hf_token", "AWS_SECRET_ACCESS_KEY", "sig" (Azure SAS).
_SECRET_NAME = re.compile(
    r"(?i)(token|secret|passw|pwd|credential|signature|apikey|api[-_]key|access[-_]?key|"
    r"private[-_]?key|session[-_]?id|auth(?!or)|(^|[-_])key($|[-_s])|(^|[-_])sig($|[-_]))"
)
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
_OPTION = re.compile(r"(-{1,2}[A-Za-z0-9][A-Za-z0-9_.-]*)=(.*)", re.S)
_ASSIGN = re.compile(r"([A-Za-z_][A-Za-z0-9_.-]*)=(.*)", re.S)


def is_secret_name(name: str) -> bool:
    """Whether an option, variable or query parameter named ``name`` holds a credential."""
    return _SECRET_NAME.search(name.lstrip("-")) is not None


def redact_url(url: str) -> str:
    """``url`` without its userinfo and without the values of credential query parameters;
    anything that is not a URL is returned as it is."""
    m = _URL.match(url)
    if m is None:
        return url
    scheme, rest = url[: m.end()], url[m.end() :]
    # The userinfo ends at the last "@" before the query: a secret may hold "/", "?" or "#". What
    # precedes an "@" is userinfo when it has a ":" (user:secret) or no "/" (a token alone);
    # "bucket/run@v2" is a path. Either way, when in doubt the text goes.
    at = rest.rfind("@")
    if at >= 0:
        before = rest[:at]
        if ":" in before or "/" not in before or "?" in before or "#" in before:
            rest = rest[at + 1 :]
    rest = rest.split("#", 1)[0]  # a fragment is never needed to reach a store
    path, q, query = rest.partition("?")
    if not q:
        return scheme + path
    kept = []
    for item in query.split("&"):
        key, eq, _ = item.partition("=")
        kept.append(f"{key}={MASK}" if eq and is_secret_name(key) else item)
    return f"{scheme}{path}?{'&'.join(kept)}"


def redact_text(text: str) -> str:
    """Every URL inside a line of text redacted (an error message that quotes the remote)."""
    return re.sub(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"]+", lambda m: redact_url(m.group(0)), text)


def redact_argv(argv: list[str]) -> list[str]:
    """A command line as it may be recorded: values of secret options masked (``--x-token=V``,
    ``--x-token V``, ``X_TOKEN=V``), credentials removed from URL arguments."""
    out: list[str] = []
    hide_next = False
    for arg in argv:
        if hide_next:
            hide_next = False
            if not arg.startswith("-") or arg == "-":
                out.append(MASK)
                continue
        m = _OPTION.fullmatch(arg) or _ASSIGN.fullmatch(arg)
        if m is not None and is_secret_name(m.group(1)):
            out.append(f"{m.group(1)}={MASK}")
            continue
        if arg.startswith("-") and not arg.startswith("---") and "=" not in arg and is_secret_name(arg):
            hide_next = True
            out.append(arg)
            continue
        out.append(redact_text(arg))
    return out
