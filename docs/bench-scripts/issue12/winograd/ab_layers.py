"""Per conv shape fwd / bwd wall ms: Winograd vs im2col (same worktree code, rule toggled),
alternated per rep in one process. batch 64, float32, one BLAS thread, argv[1] compute threads."""
import sys, time, numpy as np
from hpcdl.comm import blas_threads
from hpcdl.nn import Conv2d, conv
from hpcdl.nn.model import bind_flat
blas_threads.use_layer_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
reps = int(sys.argv[2]) if len(sys.argv) > 2 else 16
rng = np.random.default_rng(0)
cases = [("r 3->16 32", 3, 16, 1, 32, 1), ("r 16->16 32", 16, 16, 1, 32, 6),
         ("r 32->32 16", 32, 32, 1, 16, 5), ("r 64->64 8", 64, 64, 1, 8, 5),
         ("c 3->32 32", 3, 32, 1, 32, 1), ("c 32->32 v", 32, 32, 0, 32, 1),
         ("c 32->64 15", 32, 64, 1, 15, 1), ("c 64->64 v", 64, 64, 0, 15, 1)]
only = sys.argv[3].split(",") if len(sys.argv) > 3 else None
import os; conv.WINOGRAD_CHUNK_BYTES = int(os.environ.get("WCB", conv.WINOGRAD_CHUNK_BYTES))
if os.environ.get("BUFS"): np.setbufsize(int(os.environ["BUFS"]))
tot = {}
for name, ci, co, p, h, cnt in cases:
    if only and name not in only: continue
    layer = Conv2d(ci, co, 3, 1, p, bias=name[0] == "c"); bind_flat(layer, np, np.float32, 0)
    layer.input_grad = ci != 3
    x = rng.standard_normal((64, h, h, ci)).astype(np.float32)
    dy = rng.standard_normal(layer.forward(x).shape).astype(np.float32)
    t = {s: ([], []) for s in ("im2col", "winograd")}
    for rep in range(reps):
        for side in t:
            conv.WINOGRAD_MIN_CHANNELS = conv.WINOGRAD_THREADED_MIN_CHANNELS = 1 if side == "winograd" else 10**9
            conv.WINOGRAD_THREADED_MIN_SIZE = 1
            t0 = time.perf_counter(); layer.forward(x); t1 = time.perf_counter(); layer.backward(dy); t2 = time.perf_counter()
            assert layer.winograd == (side == "winograd")
            t[side][0].append(t1 - t0); t[side][1].append(t2 - t1)
    line = name.ljust(13)
    for side, (f, b) in t.items():
        mf, mb = np.median(f[3:]) * 1e3, np.median(b[3:]) * 1e3
        a = tot.setdefault((name[0], side), [0.0, 0.0]); a[0] += cnt * mf; a[1] += cnt * mb
        line += f" {side} {mf:6.2f} {mb:6.2f} |"
    print(line, "chunk", layer.chunk, flush=True)
for (m, side), (f, b) in tot.items():
    print(f"total {m} {side:8s}: fwd {f:6.1f} bwd {b:6.1f}")
