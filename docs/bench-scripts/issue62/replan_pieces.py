"""Issue 62, pieces: one node's plan at ImageNet scale (1.28 M samples in 1,024 tar shards of about
140 MB, 8 ranks a node, batch 32) with whole shards (--peer-ranges off) and with pieces (auto):
RollingPlan.make and the plan file's rendering, the entries and their bytes. Usage:
    python docs/bench-scripts/issue62/replan_pieces.py NODES
"""
import sys, time
import numpy as np
from types import SimpleNamespace
from hpcdl.data.dataset import FileTable
from hpcdl.data.sampler import SamplerSpec
from hpcdl.data.tarshards import TarShardDataset
from hpcdl.staging.peers import file_homes
from hpcdl.staging.pieces import PieceSlots, split_shards
from hpcdl.staging.plan import plan_bytes
from hpcdl.staging.rolling_plan import RollingPlan

D, S, NODES, RPN, B = 1_281_167, 1024, int(sys.argv[1]), 8, 32
rng = np.random.default_rng(0)
per = np.full(S, D // S); per[: D % S] += 1
offsets = np.concatenate([[0], np.cumsum(per)[:-1]]).astype(np.int64)
lens = rng.integers(60_000, 160_000, D).astype(np.int64)
at = np.zeros(D, np.int64)
for s in range(S):
    a, b = offsets[s], offsets[s] + per[s]
    sizes = 1024 + ((lens[a:b] + 511) // 512) * 512 + 1024
    at[a:b] = np.concatenate([[0], np.cumsum(sizes)[:-1]]) + 512
shard_sizes = np.array([at[offsets[s] + per[s] - 1] + lens[offsets[s] + per[s] - 1] + 2048 for s in range(S)])
ds = TarShardDataset.__new__(TarShardDataset)
ds.root = "/pfs/imagenet"; ds.offsets = offsets; ds._shard_of_sample = None
ds.labels = np.zeros(D, np.int64); ds.kind = "tar"
ds.files = FileTable.from_entries([f"shard-{s:06d}.tar" for s in range(S)], shard_sizes)
ds.index = SimpleNamespace(columns={"data_at": at, "data_len": lens})
world = NODES * RPN
spec = SamplerSpec(num_samples=D, world_size=world, seed=0, shuffle="global")
layout = [tuple(range(n * RPN, (n + 1) * RPN)) for n in range(NODES)]
t = time.perf_counter()
homes = file_homes(ds, spec, B, (0, 90), layout, [True] * NODES)
print(f"homes {time.perf_counter() - t:.2f} s")
slots = PieceSlots(ds)
node = 5
for mode in ("off", "auto", "off", "auto"):
    plan = RollingPlan(ds, spec, B, (0, 90), node, layout[node])
    if mode != "off":
        plan.slots = slots
        plan.split = lambda a, b: split_shards(a, b, slots, homes, [True] * NODES, "auto")
    t = time.perf_counter(); p = plan.make(3); t1 = time.perf_counter()
    data = plan_bytes(p, ds, "0" * 16, "key", [], plan.slots); t2 = time.perf_counter()
    print(f"{mode}: make {t1 - t:.2f} s, render {t2 - t1:.2f} s, {p.files} entries, "
          f"{int(p.sizes.sum()) / 1e9:.2f} GB, plan {len(data) / 1e6:.1f} MB")
