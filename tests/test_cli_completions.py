"""completions/: the committed bash, zsh and fish scripts are what the app generates now, and the
bash one completes commands, options and choices when sourced into a real bash."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from smartckpt_cli.cli.app import app
from smartckpt_cli.cli.completion_scripts import SHELLS, collect, render

DIR = Path(__file__).resolve().parents[1] / "completions"
REGEN = "for s in bash zsh fish; do smartckpt completions $s > completions/smartckpt.$s; done"


@pytest.mark.parametrize("shell", SHELLS)
def test_committed_script_is_up_to_date(shell: str) -> None:
    want = render(typer.main.get_command(app), shell)
    path = DIR / f"smartckpt.{shell}"
    assert path.exists(), f"{path} is missing; run: {REGEN}"
    assert path.read_text() == want, f"{path} is out of date with the app; run: {REGEN}"


@pytest.mark.parametrize("shell", SHELLS)
def test_command_prints_the_same_script(shell: str) -> None:
    result = CliRunner().invoke(app, ["completions", shell])
    assert result.exit_code == 0
    assert result.stdout == render(typer.main.get_command(app), shell)


def test_tree_has_every_command_alias_and_choice() -> None:
    spec = collect(typer.main.get_command(app))
    names = {a for c in spec.subcommands for a in c.aliases}
    assert {"inspect", "ls", "verify", "prune", "rollback", "export", "config", "completions"} <= names
    export = next(c for c in spec.subcommands if c.path == ("export",))
    fmt = next(o for o in export.options if "--format" in o.flags)
    assert fmt.choices == ("torch", "safetensors") and fmt.takes_value
    config = next(c for c in spec.subcommands if c.path == ("config",))
    assert [s.path for s in config.subcommands] == [("config", "show")]
    assert any("-h" in o.flags for o in export.options)


def _bash_complete(words: list[str]) -> list[str]:
    script = DIR / "smartckpt.bash"
    line = " ".join(words)
    cmd = (
        f"source {script}; COMP_WORDS=({line}); COMP_CWORD={len(words) - 1}; "
        '_smartckpt; printf "%s\\n" "${COMPREPLY[@]}"'
    )
    out = subprocess.run(["bash", "--norc", "-c", cmd], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return [w for w in out.stdout.splitlines() if w]


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_bash_script_completes() -> None:
    assert subprocess.run(["bash", "-n", str(DIR / "smartckpt.bash")]).returncode == 0
    assert {"inspect", "ls", "verify", "prune", "rollback", "export"} <= set(
        _bash_complete(["smartckpt", "''"])
    )
    assert _bash_complete(["smartckpt", "ro"]) == ["rollback"]
    assert set(_bash_complete(["smartckpt", "rollback", "d", "--"])) >= {"--to", "--to-prev", "--undo"}
    assert _bash_complete(["smartckpt", "export", "d", "o", "--format", "''"]) == ["torch", "safetensors"]
    assert _bash_complete(["smartckpt", "config", "''"]) == ["show", "-h", "--help"]
    assert "--set" in _bash_complete(["smartckpt", "config", "show", "--"])
    assert _bash_complete(["smartckpt", "completions", "''"]) == ["bash", "zsh", "fish"]


@pytest.mark.parametrize("shell", ["zsh", "fish"])
def test_other_shells_parse_when_installed(shell: str) -> None:
    exe = shutil.which(shell)
    if exe is None:
        pytest.skip(f"{shell} is not installed here")
    assert subprocess.run([exe, "-n", str(DIR / f"smartckpt.{shell}")]).returncode == 0


def test_completions_as_a_real_process() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "smartckpt_cli.cli.app", "completions", "bash"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and proc.stdout == (DIR / "smartckpt.bash").read_text()
    bad = subprocess.run(
        [sys.executable, "-m", "smartckpt_cli.cli.app", "completions", "tcsh"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
