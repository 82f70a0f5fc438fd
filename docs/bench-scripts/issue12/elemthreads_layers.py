"""Per-layer fwd+bwd ms, compute_threads 1 vs 2 alternated, same process (float32)."""
import sys, time, numpy as np
from hpcdl import backend
from hpcdl.comm import blas_threads
from hpcdl.nn import threads
from hpcdl.nn import BatchNorm, ReLU, MaxPool2d, Dropout, Linear
from hpcdl.nn.model import bind_flat
blas_threads.use_layer_threads(2)  # OpenBLAS really on 1 thread
if len(sys.argv) > 1: threads.MIN_SPLIT_ELEMENTS = int(sys.argv[1])
rng = np.random.default_rng(0)
cases = [("bn 64x32x32x16", lambda: BatchNorm(16), (64,32,32,16)),
         ("bn 64x16x16x32", lambda: BatchNorm(32), (64,16,16,32)),
         ("bn 64x8x8x64", lambda: BatchNorm(64), (64,8,8,64)),
         ("relu 64x32x32x16", lambda: ReLU(), (64,32,32,16)),
         ("relu 64x16x16x32", lambda: ReLU(), (64,16,16,32)),
         ("relu 64x8x8x64", lambda: ReLU(), (64,8,8,64)),
         ("maxpool 64x32x32x32", lambda: MaxPool2d(2), (64,32,32,32)),
         ("dropout 64x16x16x32", lambda: Dropout(0.25), (64,16,16,32)),
         ("linear 64x4096->512", lambda: Linear(4096, 512), (64,4096))]
for name, make, shape in cases:
    layer = make(); bind_flat(layer, np, np.float32, 0)
    x = rng.standard_normal(shape).astype(np.float32); dy = rng.standard_normal(layer.forward(x).shape).astype(np.float32)
    times = {1: [], 2: []}
    for rep in range(30):
        for t in (1, 2):
            backend.set_compute_threads(t)
            t0 = time.perf_counter(); layer.forward(x.copy() if isinstance(layer, ReLU) else x); layer.backward(dy); times[t].append(time.perf_counter() - t0)
    a, b = (np.median(times[t][5:]) * 1e3 for t in (1, 2))
    print(f"{name:24s} 1 thread {a:6.3f}  2 threads {b:6.3f}  ratio {b/a:.2f}")
