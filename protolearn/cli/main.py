"""Entry point of the ``protolearn`` command.

Sub-commands live in sibling modules and register themselves on :data:`app` here. Every
:class:`~protolearn.errors.ProtolearnError` becomes one readable line on stderr and exit code 1.
"""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from protolearn.errors import ProtolearnError

app = typer.Typer(
    name="protolearn",
    help="Train one language model together over the internet.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            print(f"protolearn {version('protolearn')}")
        except PackageNotFoundError:
            print("protolearn (not installed as a package)")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")] = False,
) -> None:
    # A callback keeps `protolearn <command>` a group even while only one command is registered
    # (typer otherwise runs a lone command as the app itself).
    """Train one language model together over the internet."""


def _plain_flags() -> None:
    """typer 0.2x labels every on/off flag (even --help) with the type ``<bool>`` in --help, as if it took
    a value; a flag takes none, so it gets no label. (Typer versions without the hook need nothing.)"""
    from typer.core import TyperOption

    shown = getattr(TyperOption, "display_type_rich", None)
    if shown is None or getattr(shown, "_protolearn", False):
        return

    def display_type_rich(self: TyperOption, ctx: object) -> str | None:
        if self.is_flag and self.metavar is None:
            return None
        return shown(self, ctx)

    display_type_rich._protolearn = True  # type: ignore[attr-defined]
    TyperOption.display_type_rich = display_type_rich  # type: ignore[method-assign]


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
    from protolearn.cli import generate, model

    model.register(app)
    generate.register(app)


def main() -> None:
    _plain_flags()
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
