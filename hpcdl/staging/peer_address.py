"""Which address a node leader's peer tier listens on: one the other nodes reach, by address.

A node's name is not a reliable way there: some sites' nodes reach each other by address but
cannot resolve each other's names (or not their own), or the name belongs to a management
network. The node watch (hpcdl.comm.node_watch) connects by address for that reason, and so
does the peer tier: every node leader gathers the IPv4 addresses of every node's interfaces,
and listens on
- its name's address, when the name resolves to one of its own interfaces (the site's choice,
  as before), else
- the address its kernel routes from toward another node's interfaces (a connected UDP socket
  names its source address; no packet is sent), the next node's first, then the others: the
  interface the nodes' own traffic, MPI's included, goes through.
A node where neither works serves and fetches nothing; the caller says so in one line.
"""

from __future__ import annotations

import contextlib
import socket
from typing import Any

from hpcdl.comm.node_watch import interface_addresses


def listen_address(world: Any) -> tuple[str | None, str]:
    """Collective over world.comm. On a node leader: (the address to listen on, "") or (None,
    why not); (None, "") on the other ranks."""
    mine = interface_addresses() if world.is_node_leader else None
    every = world.comm.allgather(mine)
    if not world.is_node_leader:
        return None, ""
    nodes = [every[ranks[0]] or [] for ranks in world.ranks_by_node]
    own = set(nodes[world.node_index])
    named = _name_address()
    if named in own:
        return named, ""
    count = len(nodes)
    for step in range(1, count):
        for peer in nodes[(world.node_index + step) % count]:
            source = _source_toward(peer)
            if source in own:
                return source, ""
    return None, (
        f"none of this node's addresses ({', '.join(sorted(own)) or 'none'}) routes to another "
        "node's, and its name does not resolve to one of them"
    )


def own_address() -> tuple[str | None, str]:
    """Without the other nodes (not collective): this node's name's address when it is one of
    its interfaces, else its first non-loopback interface's; or (None, why not)."""
    own = interface_addresses()
    named = _name_address()
    if named in own:
        return named, ""
    if own:
        return own[0], ""
    return None, "this node has no IPv4 address other than loopback"


def _name_address() -> str | None:
    with contextlib.suppress(OSError):
        return socket.gethostbyname(socket.gethostname())
    return None


def _source_toward(address: str) -> str | None:
    """The source address this host's routing picks for packets to address, or None."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect((address, 9))  # UDP: no packet is sent
        return probe.getsockname()[0]
    except OSError:
        return None
    finally:
        probe.close()
