"""Print the README's command table as the CLI defines it; ``--write`` updates README.md in place.

    .venv/bin/python scripts/cli_table.py            # print it
    .venv/bin/python scripts/cli_table.py --write    # rewrite the table between the markers in README.md
"""

from __future__ import annotations

import sys
from pathlib import Path

from protolearn.cli.help_table import command_table, with_table

README = Path(__file__).resolve().parent.parent / "README.md"

if __name__ == "__main__":
    if "--write" in sys.argv[1:]:
        README.write_text(with_table(README.read_text(encoding="utf-8")), encoding="utf-8")
        print(f"updated the command table in {README}")
    else:
        sys.stdout.write(command_table())
