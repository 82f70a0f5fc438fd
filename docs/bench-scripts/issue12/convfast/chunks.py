import time, sys, numpy as np
from hpcdl.comm import blas_threads
from hpcdl.nn import Conv2d
from hpcdl.nn.model import bind_flat
import hpcdl.nn.conv as conv
blas_threads.use_layer_threads(2)
sizes = [1 << 19, 1 << 20, 1 << 21, 1 << 22]
for ci, co, s, h, pad in [(16, 16, 1, 32, 1), (32, 32, 1, 16, 1), (64, 64, 1, 8, 1), (32, 32, 1, 32, 0), (16, 32, 2, 32, 1)]:
    layer = Conv2d(ci, co, 3, s, pad, bias=False); bind_flat(layer, np, np.float32, 0)
    x = np.random.rand(64, h, h, ci).astype(np.float32); dy = np.random.rand(*layer.forward(x).shape).astype(np.float32)
    r = {k: [] for k in sizes}
    for rep in range(16):
        for k in sizes:
            conv.CHUNK_BYTES = k
            t0 = time.perf_counter(); layer.forward(x); layer.backward(dy); r[k].append(time.perf_counter() - t0)
    print(ci, co, s, h, " ".join(f"{k>>10}K {np.median(v[3:])*1e3:6.2f}" for k, v in r.items()))
