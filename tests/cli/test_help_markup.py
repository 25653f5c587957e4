"""Every `--help` text says what its source says: no bracketed word lost to rich's markup.

Typer renders help through rich, which reads `[plot]` in "pip install 'cbrun[plot]'" as a style tag and drops it
(the text must escape it, `\\[plot]`). For every option and argument of every command, each bracketed part of its
help, as the user should read it, must appear in the rendered `--help`.
"""

from __future__ import annotations

import re

import pytest
import typer
from typer.testing import CliRunner

from cbrun.cli.app import app

_COMMAND = typer.main.get_command(app)
_BRACKETED = re.compile(r"\[[^\[\]]*\]")


def _commands() -> list[tuple[str, object]]:
    commands = getattr(_COMMAND, "commands", {})  # typer's group (its own click)
    assert {"generate", "score", "info", "bench"} <= set(commands)
    return list(commands.items())


def _plain(text: str) -> str:
    """Rendered help without rich's panel borders and line wrapping."""
    return " ".join(text.replace("│", " ").replace("╭", " ").replace("╰", " ").split())


@pytest.mark.parametrize("name,command", _commands(), ids=[name for name, _ in _commands()])
def test_help_keeps_every_bracketed_part_of_its_source(name, command):
    result = CliRunner().invoke(app, [name, "--help"], env={"COLUMNS": "200", "NO_COLOR": "1", "TERM": "dumb"})
    assert result.exit_code == 0, result.output
    rendered = _plain(result.output)
    expected = [command.help or ""] + [getattr(param, "help", None) or "" for param in command.params]
    for text in expected:
        for part in _BRACKETED.findall(text.replace("\\[", "[")):
            assert _plain(part) in rendered, f"`cbrun {name} --help` lost {part!r} (escape its '[' as '\\['): {text!r}"


def test_the_check_finds_a_lost_extra():
    """The test above can fail: an unescaped extra is eaten by the renderer it checks."""
    probe = typer.Typer(rich_markup_mode="rich")

    @probe.command()
    def plot(out: str = typer.Option("", help="Needs pip install 'cbrun[plot]'.")) -> None:
        """A probe."""

    rendered = _plain(CliRunner().invoke(probe, ["--help"], env={"COLUMNS": "200"}).output)
    assert "'cbrun[plot]'" not in rendered and "'cbrun'" in rendered
