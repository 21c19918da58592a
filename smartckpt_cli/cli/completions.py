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
    ctx: typer.Context,
    shell: Annotated[Shell, typer.Argument(help="bash, zsh or fish.", show_default=False)],
) -> None:
    """Print the bash, zsh or fish completion script for smartckpt.

    The script is static (generated from this app): a tab never starts Python.

    \b
    Examples:
      smartckpt completions bash \\
        > ~/.local/share/bash-completion/completions/smartckpt
      smartckpt completions zsh > "${fpath[1]}/_smartckpt"
      smartckpt completions fish > ~/.config/fish/completions/smartckpt.fish
      for s in bash zsh fish; do
        smartckpt completions $s > completions/smartckpt.$s; done
    """
    from smartckpt_cli.cli.completion_scripts import render

    # The root command of the running app (no import of cli.app: that would be a cycle).
    typer.echo(render(ctx.find_root().command, shell.value), nl=False)
