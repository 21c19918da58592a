"""``smartckpt config show``: the effective settings and where each one came from."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from smartckpt_cli.cli._shared import out

__all__ = ["config_app"]

config_app = typer.Typer(
    name="config",
    help="Settings: smartckpt.yaml (or --config) < SMARTCKPT_* variables < flags.",
    no_args_is_help=True,
    context_settings={"help_option_names": ["-h", "--help"]},
)


@config_app.command("show")
def show(
    config: Annotated[
        Path | None,
        typer.Option("--config", help="YAML settings file (default ./smartckpt.yaml when present)."),
    ] = None,
    set_: Annotated[
        list[str] | None,
        typer.Option("--set", help="KEY=VALUE, as a command-line flag would set it (repeatable)."),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """Print every setting's effective value and its source: default, the YAML file,
    an environment variable, or a flag. Unknown keys and wrong types are errors naming the key.

    \b
    Examples:
      smartckpt config show
      smartckpt config show --config train.yaml
      SMARTCKPT_KEEP_LAST=5 smartckpt config show --set precision=bf16

    Exit codes: 0 shown, 2 a bad setting (unknown key, wrong type, missing --config file).
    """
    from smartckpt_cli.ops.config_report import effective_settings, parse_assignments

    rows, path = effective_settings(config, parse_assignments(set_ or []))
    if as_json:
        typer.echo(
            json.dumps(
                {"file": path, "settings": {r.key: {"value": r.value, "source": r.source} for r in rows}},
                indent=2,
                default=str,
            )
        )
        return
    table = Table(title=f"settings (file: {escape(path) if path else 'none'})", title_justify="left")
    for col in ("setting", "value", "source"):
        table.add_column(col)
    for r in rows:
        value = json.dumps(r.value, default=str) if not isinstance(r.value, str) else r.value
        style = "" if r.source == "default" else "bold"
        table.add_row(r.key, escape(value), escape(r.source), style=style)
    out().print(table)
