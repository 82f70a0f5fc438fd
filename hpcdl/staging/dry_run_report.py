"""What `python -m hpcdl.stage --dry-run` prints of its plan: a line per node, a line per epoch
of all nodes' copies, the shape samples reach the model in, and --json's object. Byte sizes are
in binary units, as hpcdl-stage prints them (hpcdl.units.binary_size)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from hpcdl.staging.peers import EpochSources
from hpcdl.units import binary_size


def epoch_rows(sources: EpochSources) -> list[dict[str, int]]:
    """The dry run's per-epoch copies of all nodes: from the PFS without peers (staged_*), and
    with the peer tier (pfs_* + peer_*; docs/staging.md, "Peer tier")."""
    names = ("staged_files", "staged_bytes", "pfs_files", "pfs_bytes", "peer_files", "peer_bytes")
    columns = [getattr(sources, name).tolist() for name in names]
    return [dict(epoch=k, **dict(zip(names, row))) for k, row in enumerate(zip(*columns))]


def print_dry_run(
    args: argparse.Namespace,
    ds: Any,
    rows: list[dict[str, Any]],
    nodes: int,
    per: int,
    capacity: int,
    threads: int,
    epochs: list[dict[str, int]],
) -> None:
    """The dry run's report: one line per node, one per epoch, then --json's object."""
    shape = loader_shape(ds, args.augment)
    print(
        f"staging plan: {nodes} nodes x {per} ranks ({args.placement} placement), batch "
        f"{args.batch_size}, seed {args.seed}, shuffle {args.shuffle}; first epoch per node "
        f"(whole run of {args.epochs} epochs):"
    )
    if shape is not None:
        print(f"  samples reach the model as {shape} (C, H, W) with --augment {args.augment}")
    for r in rows:
        print(
            f"  node {r['node']}: {r['files']} files, {binary_size(r['bytes'])}, "
            f"{'fits' if r['fits'] else 'does NOT fit'} in {binary_size(capacity)}; "
            f"~{r['est_seconds']:.1f} s at {r['pfs_open_latency_ms']:.2f} ms/open, "
            f"{r['pfs_mbps']:.0f} MB/s, {threads} threads "
            f"(run: {r['run_files']} files, {binary_size(r['run_bytes'])})"
        )
    if nodes > 1:
        print("  copies per epoch, all nodes: without peers | with --peer-staging (PFS + peers):")
        for e in epochs:
            print(
                f"  epoch {e['epoch']}: {e['staged_files']} files, "
                f"{binary_size(e['staged_bytes'])} from the PFS | {e['pfs_files']} files, "
                f"{binary_size(e['pfs_bytes'])} from the PFS + {e['peer_files']} files, "
                f"{binary_size(e['peer_bytes'])} from peers"
            )
        if getattr(ds, "kind", "") == "tar":
            print("  (peer copies counted as whole shards; with --peer-ranges auto, the default, "
                  "a node fetches its samples of a shard as pieces where they cost less: fewer "
                  'bytes; docs/staging.md, "Pieces")')  # fmt: skip
    if args.json:
        shape_list = shape and list(shape)
        print(json.dumps({"nodes": rows, "epochs": epochs, "sample_shape": shape_list}))


def loader_shape(ds: Any, augment: str) -> tuple[int, int, int] | None:
    """(C, H, W) the training loader yields for ds (hpcdl.data.batch.output_shape); None for a
    plain file tree (--files-only), whose files are not samples."""
    if not hasattr(ds, "sample_shape"):
        return None
    from hpcdl.data.augment import parse_augment  # noqa: PLC0415
    from hpcdl.data.batch import output_shape  # noqa: PLC0415

    return output_shape(ds, parse_augment(augment))
