"""What one later epoch's boundary costs a rank's training thread at ImageNet scale: every rank
draws its epoch's sample order (DistributedSampler.indices), and local rank 0 also replans its
node for the stager (hpcdl.staging.session: plan_for_node over the current and the next epoch,
render_plan, the atomic write). The other ranks wait for local rank 0 at the next allreduce, so
its extra time is a stall of the whole job. ImageNet-1k's 1,281,167 files, 8 ranks per node,
batch 32 (docs/calibrations/imagenet-lustre-a100.toml), no peer section; the mean of epochs 2-5.

Usage: python docs/bench-scripts/issue35/replan_cost.py [NODES ...] (default 16 128 1024)"""

import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[2])]  # the repository root

import numpy as np  # noqa: E402

from hpcdl.data.dataset import FileTable  # noqa: E402
from hpcdl.data.sampler import SamplerSpec, rank_layout  # noqa: E402
from hpcdl.staging.plan import plan_for_node, write_plan  # noqa: E402

FILES, PER_NODE, BATCH, EPOCHS = 1_281_167, 8, 32, range(2, 6)


def imagenet_like() -> SimpleNamespace:
    names = [f"train/n{i // 1300:08d}/n{i // 1300:08d}_{i:06d}.JPEG" for i in range(FILES)]
    files = FileTable.from_entries(names, [110_000] * FILES)
    return SimpleNamespace(root="/pfs/imagenet", files=files, file_ids=np.asarray)


def boundary(ds, spec: SamplerSpec, plan_path: Path | None) -> float:
    """Seconds of the epoch boundaries EPOCHS of one rank (local rank 0 where plan_path)."""
    sampler = spec.for_rank(0)
    ranks = tuple(range(PER_NODE))
    if plan_path is not None:  # where a job is as epoch 2 starts: epoch 1's replan drew epoch 2
        plan_for_node(ds, spec, BATCH, (EPOCHS[0] - 1, EPOCHS[0] + 1), ranks, 0)
    began = time.perf_counter()
    for epoch in EPOCHS:
        sampler.batches(epoch, BATCH)  # hpcdl.run.Run.batches, at the epoch's start
        if plan_path is not None:  # hpcdl.staging.session.StagingSession._replan, at step 1
            plan = plan_for_node(ds, spec, BATCH, (epoch, epoch + 2), ranks, 0)
            write_plan(plan_path, plan, ds, "0" * 16, "key")
    return (time.perf_counter() - began) / len(EPOCHS)


def main() -> None:
    ds = imagenet_like()
    print("nodes  shuffle  every rank (ms)  local rank 0 (ms)  its extra (ms)")
    with tempfile.TemporaryDirectory() as tmp:
        for nodes in [int(a) for a in sys.argv[1:]] or [16, 128, 1024]:
            for shuffle in ("global", "node"):
                spec = SamplerSpec(FILES, PER_NODE * nodes, 0, shuffle,
                                   rank_layout([PER_NODE] * nodes))  # fmt: skip
                boundary(ds, spec, Path(tmp) / "plan")  # warm-up: what a process does once
                rank = boundary(ds, spec, None)
                leader = boundary(ds, spec, Path(tmp) / "plan")
                print(f"{nodes:5d}  {shuffle:7s}  {rank * 1e3:15.1f}  {leader * 1e3:17.1f}  "
                      f"{(leader - rank) * 1e3:14.1f}")


if __name__ == "__main__":
    main()
