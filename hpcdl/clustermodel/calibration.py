"""The calibration file: what the cluster model (hpcdl.clustermodel) knows about a machine.

`python -m hpcdl.bench calibrate --out FILE` measures these figures on the machine it runs on; a
site can also write them by hand (docs/cluster-model.md lists every field, its unit and where
a figure usually comes from). The file is TOML with four tables and an optional fifth;
every figure is a plain number in SI units (seconds, bytes, bytes/s), so nothing needs a unit
parser:

    version = 1
    [pfs]        open_latency_s, thread_bandwidth_Bps, node_bandwidth_Bps,
                 total_bandwidth_Bps, total_opens_per_s   (0 = no such limit)
    [local]      write_bandwidth_Bps
    [network]    intra_alpha_s, intra_beta_s_per_B, inter_alpha_s, inter_beta_s_per_B, algorithm,
                 algorithm_factor
    [compute]    model, batch_size, v0, t, backward_fraction, gradient_bytes,
                 input_s_per_sample, contention_s_per_file   (optional, 0 = not charged),
                 contention_s_per_fetch   (optional; absent = contention_s_per_file),
                 permute_s_per_sample, replan_s, replan_s_per_entry   (optional, 0)
    [peer]       fetch_latency_s, thread_bandwidth_Bps, node_bandwidth_Bps   (optional)

[peer] is the staging peer tier's fetch of a staged copy from another node's stager (issue 35).
A file without it (written before the peer tier) still loads: the figures of DEFAULT_PEER,
with the node's bandwidth capped by [network]'s link between nodes (peer_figures).

Optional text fields (`source`, `notes` in any table) say where a figure came from.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import Any

from hpcdl.atomic import write_bytes_atomically

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

VERSION = 1
ALGORITHMS = ("hierarchical", "ring")


class CalibrationError(ValueError):
    """A calibration file that cannot be used; the message names the file and the field."""


@dataclass(frozen=True)
class PfsFigures:
    open_latency_s: float  # one open (+ close) of a file, one reader thread
    thread_bandwidth_Bps: float  # read bandwidth of one reader thread, bytes/s
    node_bandwidth_Bps: float = 0.0  # one client node's limit (NIC, client cache), 0 = none
    total_bandwidth_Bps: float = 0.0  # the whole file system, shared by all nodes, 0 = none
    total_opens_per_s: float = 0.0  # metadata servers: opens/s for all nodes, 0 = none


@dataclass(frozen=True)
class LocalFigures:
    write_bandwidth_Bps: float  # node-local SSD, bytes/s, all copy threads together


@dataclass(frozen=True)
class NetworkFigures:
    intra_alpha_s: float  # latency per message inside a node
    intra_beta_s_per_B: float  # seconds per byte inside a node (1 / bandwidth)
    inter_alpha_s: float  # latency per message between nodes
    inter_beta_s_per_B: float  # seconds per byte on a node's link
    algorithm: str = "hierarchical"  # what the MPI does across nodes: hierarchical or ring
    algorithm_factor: float = 1.0  # measured world allreduce / the algorithm's formula


@dataclass(frozen=True)
class ComputeFigures:
    model: str  # the network the step was timed for
    batch_size: int  # per-rank batch of the timed steps
    v0: float  # images/s of one rank in the limit of large batches (hpcdl.clustermodel.speed)
    t: float  # seconds of fixed cost per step (launches, update); step = b / v0 + t
    backward_fraction: float  # share of a step spent in backward, where the allreduce overlaps
    gradient_bytes: int  # bytes allreduced per step (parameters x bytes per gradient)
    # One sample's read of its staged copy, decode and augmentation where the rank builds its
    # batch itself (--workers 0); loader workers take it off the step (equations.step_time).
    # 0: not measured (a file written before this field), the loaders keep up.
    input_s_per_sample: float = 0.0
    # Training seconds a node loses per file its stager copies from the PFS while the ranks
    # train: shared cores, the file system client (hpcdl.bench.calibrate_contention).
    # 0: not measured, or cores to spare.
    contention_s_per_file: float = 0.0
    # The same per file a node fetches from a peer (and, at the same rate, serves to one),
    # the fetches released at once as a job's next epoch's are. None (absent from the file,
    # written before this field, or one node): a fetch costs what a PFS copy costs.
    contention_s_per_fetch: float | None = None
    # The epoch's start (equations.boundary_s): drawing its sample order, per sample permuted,
    # and local rank 0's rewrite of its node's plan, a fixed part and per plan entry
    # (hpcdl.bench.calibrate_boundary). 0: not measured (a file written before them).
    permute_s_per_sample: float = 0.0
    replan_s: float = 0.0
    replan_s_per_entry: float = 0.0
    # One checkpoint of this model as hpcdl.train writes it (rank 0, hpcdl.checkpoint.save into
    # bench calibrate's --checkpoint-dir); the other ranks wait for it at the next collective
    # (equations.checkpoints_per_epoch). 0: not measured, and a job's checkpoints cost nothing.
    checkpoint_s: float = 0.0

    def fetch_contention_s(self) -> float:
        """Training seconds a node loses per file it fetches from a peer."""
        if self.contention_s_per_fetch is None:
            return self.contention_s_per_file
        return self.contention_s_per_fetch

    def step_s(self, batch: int) -> float:
        """Seconds of forward + backward + update of one rank at this batch (no allreduce)."""
        return batch / self.v0 + self.t


@dataclass(frozen=True)
class PeerFigures:
    fetch_latency_s: float  # one fetch of a small file from a peer's stager, one thread
    thread_bandwidth_Bps: float  # bytes/s of one fetching thread
    node_bandwidth_Bps: float = 0.0  # one node's fetches together, 0 = the [network] link only


# Without a [peer] table: what bench calibrate measured between two stagers on one host of the
# loaded 2-core test VM (0.37-0.85 ms per fetch, 95-170 MB/s per thread; docs/cluster-model.md),
# the latency rounded up and the bandwidth down; the link between nodes is then the [network]
# table's (peer_figures).
DEFAULT_PEER = PeerFigures(fetch_latency_s=1e-3, thread_bandwidth_Bps=100e6)


@dataclass(frozen=True)
class Calibration:
    pfs: PfsFigures
    local: LocalFigures
    network: NetworkFigures
    compute: ComputeFigures
    source: str = ""
    peer: PeerFigures | None = None  # None: no [peer] table in the file (DEFAULT_PEER)

    def to_toml(self) -> str:
        """The file's text: four tables of numbers (see the module docstring)."""
        lines = [f"version = {VERSION}"]
        if self.source:
            lines.append(f"source = {_toml_value(self.source)}")
        for name in ("pfs", "local", "network", "compute", "peer"):
            if getattr(self, name) is None:
                continue
            lines += ["", f"[{name}]"]
            lines += [f"{k} = {_toml_value(v)}" for k, v in asdict(getattr(self, name)).items()
                      if v is not None]  # fmt: skip
        return "\n".join(lines) + "\n"

    def to_json(self) -> dict[str, Any]:
        return {"version": VERSION, **asdict(self)}


TABLES = {"pfs": PfsFigures, "local": LocalFigures, "network": NetworkFigures,
          "compute": ComputeFigures}  # fmt: skip


def load(path: str | Path) -> Calibration:
    """Read and check a calibration file (TOML; a .json file with the same keys also works)."""
    path = Path(path)
    try:
        text = path.read_text()
        if path.suffix == ".json":
            raw = json.loads(text)
        else:
            raw = tomllib.loads(text)
    except (OSError, ValueError) as exc:
        raise CalibrationError(f"calibration file {path}: {exc}") from None
    return from_dict(raw, str(path))


def from_dict(raw: dict[str, Any], where: str = "calibration") -> Calibration:
    """A Calibration from parsed TOML/JSON, with one clear error per bad field."""
    if raw.get("version") != VERSION:
        raise CalibrationError(f"{where}: version must be {VERSION}, got {raw.get('version')!r}")
    parts: dict[str, Any] = {}
    for name, cls in TABLES.items():
        table = raw.get(name)
        if not isinstance(table, dict):
            raise CalibrationError(f"{where}: missing table [{name}] (docs/cluster-model.md)")
        parts[name] = _table(cls, table, f"{where}: [{name}]")
    network = parts["network"]
    if network.algorithm not in ALGORITHMS:
        raise CalibrationError(
            f"{where}: [network] algorithm must be one of {', '.join(ALGORITHMS)}, "
            f"got {network.algorithm!r}"
        )
    compute = parts["compute"]
    if not 0.0 <= compute.backward_fraction <= 1.0:
        raise CalibrationError(f"{where}: [compute] backward_fraction must be in 0..1")
    if compute.v0 <= 0 or compute.batch_size < 1:
        raise CalibrationError(f"{where}: [compute] v0 and batch_size must be positive")
    if parts["pfs"].open_latency_s <= 0 and parts["pfs"].thread_bandwidth_Bps <= 0:
        raise CalibrationError(f"{where}: [pfs] needs open_latency_s or thread_bandwidth_Bps")
    peer = raw.get("peer")
    if peer is not None and not isinstance(peer, dict):
        raise CalibrationError(f"{where}: [peer] must be a table (docs/cluster-model.md)")
    if peer is not None:
        parts["peer"] = _table(PeerFigures, peer, f"{where}: [peer]")
        if parts["peer"].fetch_latency_s <= 0 and parts["peer"].thread_bandwidth_Bps <= 0:
            raise CalibrationError(f"{where}: [peer] needs fetch_latency_s or thread_bandwidth_Bps")
    return Calibration(**parts, source=str(raw.get("source", "")))


def peer_figures(cal: Calibration) -> PeerFigures:
    """The peer fetch figures the model uses: the file's [peer] table, else DEFAULT_PEER; a
    node's fetches never pass its link between nodes (1 / [network] inter_beta_s_per_B)."""
    peer = cal.peer or DEFAULT_PEER
    link = 1.0 / cal.network.inter_beta_s_per_B if cal.network.inter_beta_s_per_B > 0 else 0.0
    node = min(b for b in (peer.node_bandwidth_Bps, link, math.inf) if b > 0)
    return PeerFigures(peer.fetch_latency_s, peer.thread_bandwidth_Bps,
                       0.0 if math.isinf(node) else node)  # fmt: skip


def _table(cls: type, table: dict[str, Any], where: str) -> Any:
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(table) - known - {"notes", "source"})
    if unknown:  # a misspelt optional limit would otherwise be dropped without a word
        raise CalibrationError(
            f"{where}: unknown field {unknown[0]} (known: {', '.join(sorted(known))})"
        )
    values = {}
    for f in fields(cls):
        if f.name not in table:
            if f.default is not MISSING:
                continue
            raise CalibrationError(f"{where}: missing field {f.name}")
        value = table[f.name]
        if f.type in ("float", "int", "float | None"):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise CalibrationError(f"{where}: {f.name} must be a number, got {value!r}")
            if not math.isfinite(value) or value < 0:
                raise CalibrationError(f"{where}: {f.name} must be >= 0, got {value!r}")
            value = int(value) if f.type == "int" else float(value)
        values[f.name] = value
    return cls(**values)


def _toml_value(value: Any) -> str:
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, float):
        return repr(value)
    return str(value)


def save(path: str | Path, calibration: Calibration) -> None:
    """Write the TOML file atomically (hpcdl.atomic), readable by all (mode 0644)."""
    write_bytes_atomically(path, calibration.to_toml().encode(), mode=0o644)
