"""``smartckpt completions SHELL``: print the completion script generated from this app."""

from __future__ import annotations

from enum import Enum
from typing import Annotated

import typer

__all__ = ["Shell", "completions"]


class Shell(str, Enum):
    bash = "bash"
    zsh = "zsh"
    fish = "fish"


def completions(
    shell: Annotated[Shell, typer.Argument(help="bash, zsh or fish.", show_default=False)],
) -> None:
    """Print the bash, zsh or fish completion script for smartckpt.

    The script is static (generated from this app): a tab never starts Python.

    \b
    Examples:
      smartckpt completions bash > ~/.local/share/bash-completion/completions/smartckpt
      smartckpt completions zsh > "${fpath[1]}/_smartckpt"
      smartckpt completions fish > ~/.config/fish/completions/smartckpt.fish
      for s in bash zsh fish; do smartckpt completions $s > completions/smartckpt.$s; done
    """
    from smartckpt_cli.cli.app import app
    from smartckpt_cli.completions import render

    typer.echo(render(typer.main.get_command(app), shell.value), nl=False)
