"""Entry point of the ``protolearn`` command.

Sub-commands live in sibling modules and register themselves on :data:`app` here. Every
:class:`~protolearn.errors.ProtolearnError` becomes one readable line on stderr and exit code 1.
"""

from __future__ import annotations

import sys

import typer

from protolearn.errors import ProtolearnError

app = typer.Typer(
    name="protolearn",
    help="Train one language model together over the internet.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _root() -> None:
    # A callback keeps `protolearn <command>` a group even while only one command is registered
    # (typer otherwise runs a lone command as the app itself).
    """Train one language model together over the internet."""


def _register() -> None:
    # Imported here, not at module import, so `protolearn --help` stays fast and import order is explicit.
    from protolearn.cli import local

    local.register(app)
    from protolearn.cli import demo, node

    node.register(app)
    demo.register(app)
    from protolearn.cli import coordinator, swarm

    coordinator.register(app)
    swarm.register(app)
    from protolearn.cli import model

    model.register(app)


def main() -> None:
    _register()
    try:
        app()
    except ProtolearnError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
