"""The ``--link`` / ``--links`` flags of ``protolearn demo``: which emulated link each node gets.

``--link SPEC`` gives every node the same link; ``--links FILE`` one per node, line k for node k (a
SPEC, or ``none`` for an unshaped node; ``#`` starts a comment). The grammar is
:func:`protolearn.protocol.link.parse_link`'s. Each link is checked against the transport's floor
here, so a bad one is one error line before any process starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from protolearn.errors import ConfigError
from protolearn.protocol.link import LinkSpec, parse_link, parse_links_file

LinkOption = Annotated[str | None, typer.Option(
    "--link", metavar="SPEC", help="Give every node this emulated home link: RATE,DELAY[,JITTER] or up=RATE,down=RATE,DELAY[,JITTER], e.g. 50mbit,40ms.",
)]
LinksOption = Annotated[Path | None, typer.Option("--links", metavar="FILE", help="One link per node instead: line k is node k's SPEC, or none.")]


def node_links(num_nodes: int, link: str | None, links: Path | None) -> list[LinkSpec | None]:
    """One link (or None: unshaped) per node, from the demo's flags."""
    from protolearn.protocol.transport.config import usable_link  # loads libp2p: only for a command that runs

    if link is not None and links is not None:
        raise ConfigError("--link and --links exclude each other: give every node one SPEC, or a FILE with one per node")
    if link is not None:
        return [usable_link(parse_link(link))] * num_nodes
    if links is None:
        return [None] * num_nodes
    try:
        text = links.read_text(encoding="utf-8")
    except OSError as err:
        raise ConfigError(f"--links {links}: cannot read it ({err.strerror})") from None
    specs = parse_links_file(text, where=f"--links {links}")
    if len(specs) != num_nodes:
        raise ConfigError(f"--links {links} has {len(specs)} profiles for {num_nodes} nodes; give one line per node (none for an unshaped one)")
    return [None if s is None else usable_link(s) for s in specs]


def link_flags(num_nodes: int, link: str | None, links: Path | None) -> dict[int, list[str]]:
    """The ``node join`` arguments that give each shaped node its link (by node index)."""
    return {k: ["--link", spec.text] for k, spec in enumerate(node_links(num_nodes, link, links)) if spec is not None}


def link_note(link: str | None, links: Path | None) -> str:
    """What the demo's first line says about the links."""
    return f"; link {link}" if link else (f"; links from {links}" if links else "")
