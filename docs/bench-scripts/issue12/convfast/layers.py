"""Per-conv-shape fwd / bwd ms (batch 64, float32, blas 1 thread, 2 compute threads)."""
import sys, time, numpy as np
import hpcdl
from hpcdl import backend
from hpcdl.comm import blas_threads
from hpcdl.nn import Conv2d
from hpcdl.nn.model import bind_flat
blas_threads.use_layer_threads(2)
print("using", hpcdl.__file__, file=sys.stderr)
rng = np.random.default_rng(0)
# (name, c_in, c_out, stride, pad, h, count in model)
cases = [("r 3->16 32", 3, 16, 1, 1, 32, 1), ("r 16->16 32", 16, 16, 1, 1, 32, 6),
         ("r 16->32 s2", 16, 32, 2, 1, 32, 1), ("r 32->32 16", 32, 32, 1, 1, 16, 5),
         ("r 32->64 s2", 32, 64, 2, 1, 16, 1), ("r 64->64 8", 64, 64, 1, 1, 8, 5),
         ("c 3->32 32", 3, 32, 1, 1, 32, 1), ("c 32->32 v", 32, 32, 1, 0, 32, 1),
         ("c 32->64 15", 32, 64, 1, 1, 15, 1), ("c 64->64 v", 64, 64, 1, 0, 15, 1)]
only = sys.argv[1:] 
tot = {"r": [0, 0], "c": [0, 0]}
for name, ci, co, s, p, h, cnt in cases:
    layer = Conv2d(ci, co, 3, s, p, bias=name[0] == "c"); bind_flat(layer, np, np.float32, 0)
    layer.input_grad = ci != 3
    x = rng.standard_normal((64, h, h, ci)).astype(np.float32)
    dy = rng.standard_normal(layer.forward(x).shape).astype(np.float32)
    f, b = [], []
    for rep in range(25):
        t0 = time.perf_counter(); layer.forward(x); t1 = time.perf_counter(); layer.backward(dy); t2 = time.perf_counter()
        f.append(t1 - t0); b.append(t2 - t1)
    mf, mb = np.median(f[5:]) * 1e3, np.median(b[5:]) * 1e3
    tot[name[0]][0] += cnt * mf; tot[name[0]][1] += cnt * mb
    print(f"{name:14s} fwd {mf:6.2f} bwd {mb:6.2f}")
for k, (a, b) in tot.items():
    print(f"total {k}: fwd {a:6.1f} bwd {b:6.1f}")
