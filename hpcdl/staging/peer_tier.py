"""PeerTier: the collective start of the peer tier, and what each node leader keeps of it.

At start every rank takes part once (docs/staging.md, "Peer tier"):
- world rank 0 draws the job's secret (32 random bytes) and broadcasts it over MPI; the node
  leader later writes it to its stager's stdin, a pipe, and nowhere else (not a file, the
  command line or the environment, which other users or processes could read);
- each node leader opens its listening socket on an address the other nodes reach, found by
  address as the node watch connects (hpcdl.staging.peer_address: its name's address when that
  is one of its interfaces, else the one its routes to the other nodes leave from; never
  0.0.0.0, never a loopback address), port 0, and finds its stage capacity;
- the leaders' (address, capacity, error) are gathered over the world communicator, so every
  leader computes the same homes (hpcdl.staging.peers.file_homes) from the same inputs.
With `on`, a node that cannot open its socket stops the job with one line naming the node and
the address; with `auto`, that node serves and fetches nothing (one warning) and the others go
on; rank 0 says so in one `hpcdl: rank 0: warning: peer staging is off on ...` line. The
listening socket is handed to the stager (pass_fds), and the leader keeps its own descriptor
until the session closes: a stager that dies leaves its port bound, so no other process can take
it over while the job runs (docs/staging.md, "A dead peer's port"); fetchers then find a port
that never finishes a handshake and give the node up after the deadline.
"""

from __future__ import annotations

import secrets
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hpcdl import messages
from hpcdl.config import PEER_MODES
from hpcdl.data.sampler import SamplerSpec
from hpcdl.staging.peer_address import listen_address, own_address
from hpcdl.staging.peers import FileHomes, file_homes, peer_sources, render_peer_section
from hpcdl.staging.pieces import PieceSlots, split_shards
from hpcdl.staging.plan import NodePlan, node_figures

SECRET_BYTES = 32


def peer_tier_wanted(mode: str, num_nodes: int, shuffle: str) -> bool:
    """Whether the peer tier runs: `auto` when there are 2+ nodes and a global shuffle (with
    `node` a node never reads another node's files; one node has no peer), `on` with 2+ nodes."""
    if mode not in PEER_MODES:
        raise ValueError(f"--peer-staging must be one of {', '.join(PEER_MODES)}, got {mode!r}")
    if mode == "off" or num_nodes < 2:
        return False
    return mode == "on" or shuffle == "global"


def open_listener(address: str | None = None, why: str = "") -> tuple[socket.socket | None, str]:
    """This node's listening socket on address (hpcdl.staging.peer_address.listen_address),
    port 0, or (None, why not). Neither given (the benchmarks, one node alone): own_address."""
    if address is None and not why:
        address, why = own_address()
    if address is None:
        return None, why
    try:
        listener = socket.create_server((address, 0), backlog=128)
    except OSError as exc:
        return None, f"cannot listen on {address} ({exc.strerror or exc})"
    return listener, ""


@dataclass
class PeerTier:
    """A node leader's share of the peer tier: the secret, its socket, every node's address."""

    secret_hex: str
    listener: socket.socket | None  # handed to the stager, and held here until the session ends
    addresses: list[str | None]  # per node: "ip:port", or None when it neither serves nor fetches
    homes: FileHomes  # per data set file; per status slot once pieces are used (splitter)

    @classmethod
    def start(
        cls,
        world: Any,
        dataset: Any,
        sampler: SamplerSpec,
        batch_size: int,
        epochs: tuple[int, int],
        capacity: int,
        mode: str,
    ) -> tuple[PeerTier | None, str | None]:
        """Collective over world.comm. Returns (this leader's tier or None, an error that stops
        the job or None). capacity: this node's stage capacity in bytes (leaders only)."""
        secret = world.comm.bcast(secrets.token_hex(SECRET_BYTES) if world.is_root else None, 0)
        listener, why = open_listener(*listen_address(world))  # collective
        mine = None
        if world.is_node_leader:
            address = (
                f"{listener.getsockname()[0]}:{listener.getsockname()[1]}" if listener else None
            )
            mine = (world.node_index, address, int(capacity), why)
        records = [r for r in world.comm.allgather(mine) if r is not None]
        nodes = sorted(records)
        failed = [f"node {n} ({why})" for n, address, _, why in nodes if address is None]
        error = None
        if failed and mode == "on":
            error = f"--peer-staging on: the peer tier cannot start on {', '.join(failed)}"
        if not world.is_node_leader or error is not None:
            if listener is not None:
                listener.close()
            return None, error
        if failed and world.is_root:
            messages.warn(
                f"peer staging is off on {', '.join(failed)}; those nodes read from the "
                "parallel file system",
                rank=0,
            )
        addresses = [address for _, address, _, _ in nodes]
        need = node_figures(dataset, sampler, batch_size, epochs, world.ranks_by_node).bytes
        fits = [
            address is not None and int(b) <= cap
            for b, (_, address, cap, _) in zip(need.tolist(), nodes)
        ]
        homes = file_homes(dataset, sampler, batch_size, epochs, world.ranks_by_node, fits)
        return cls(secret, listener, addresses, homes), None

    def plan_lines(self, plan: NodePlan) -> list[str]:
        """The peer section of this node's plan (none when this node cannot reach peers)."""
        if self.addresses[plan.node] is None:
            return []
        return render_peer_section(plan, peer_sources(plan, self.homes, self._up()), self.addresses)

    def splitter(
        self, slots: PieceSlots, mode: str, node: int
    ) -> Callable[[NodePlan, NodePlan], NodePlan] | None:
        """split(shard plan, piece plan) -> this node's plan with pieces (hpcdl.staging.pieces),
        or None when this node cannot reach peers. From now on the homes are per status slot."""
        shard_homes = self.homes
        self.homes = slots.homes(shard_homes)
        if self.addresses[node] is None:
            return None
        up = self._up()
        return lambda shards, pieces: split_shards(shards, pieces, slots, shard_homes, up, mode)

    def _up(self) -> list[bool]:
        return [address is not None for address in self.addresses]

    def stager_args(self) -> tuple[list[str], tuple[int, ...]]:
        """hpcdl-stage arguments and the descriptors it inherits (the secret goes on stdin)."""
        if self.listener is None:
            return ["--peer"], ()
        return ["--peer", "--peer-listen-fd", str(self.listener.fileno())], (
            self.listener.fileno(),
        )

    def close_listener(self) -> None:
        """Once no stager serves on the socket (it stopped, or never started); idempotent."""
        if self.listener is not None:
            self.listener.close()
            self.listener = None
