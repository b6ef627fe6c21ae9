"""The README's command table is the CLI's own: every command and every flag, generated from --help's
definitions, so a new flag cannot be left out of the README (and a removed one cannot stay in it)."""

from __future__ import annotations

from pathlib import Path

from protolearn.cli.help_table import command_table, readme_table

README = Path(__file__).resolve().parents[2] / "README.md"


def test_the_readme_command_table_is_the_one_the_cli_generates() -> None:
    table = readme_table(README.read_text(encoding="utf-8"))
    assert table, "README.md has lost the markers of its generated command table"
    assert table == command_table(), "README.md's command table is out of date: run `.venv/bin/python scripts/cli_table.py --write`"


def test_the_table_names_every_command_and_the_flags_a_user_asked_for() -> None:
    table = command_table()
    for command in ("demo", "coordinator start", "node join", "swarm status", "swarm export", "generate", "export", "evaluate", "train-local"):
        assert f"| `protolearn {command}` |" in table
    for flag in ("--max-steps", "--max-in-flight", "--log-level", "--eval-every", "--workdir", "--interval", "--timeout", "--history", "--announce", "--wide"):
        assert f"`{flag}`" in table, flag
    assert "--adversary" not in table and "--lease-s" not in table  # testing-only flags stay hidden
