import sys, time, cProfile, pstats, numpy as np
from hpcdl.comm import blas_threads
from hpcdl.nn import Conv2d, conv
from hpcdl.nn.model import bind_flat
blas_threads.use_layer_threads(int(sys.argv[1]))
ci, co, h = int(sys.argv[2]), int(sys.argv[2]), int(sys.argv[3])
layer = Conv2d(ci, co, 3, 1, 1, bias=False); bind_flat(layer, np, np.float32, 0)
x = np.random.default_rng(0).standard_normal((64, h, h, ci)).astype(np.float32)
dy = layer.forward(x).copy()
for wino in (True, False, True, False):
    conv.winograd_faster = lambda *a: wino
    ts = []
    for _ in range(15):
        t0 = time.perf_counter(); layer.forward(x); t1 = time.perf_counter(); layer.backward(dy); t2 = time.perf_counter(); ts.append((t1-t0, t2-t1))
    print(wino, np.median(ts, axis=0) * 1e3)
conv.winograd_faster = lambda *a: True
pr = cProfile.Profile(); pr.enable()
for _ in range(10): layer.forward(x); layer.backward(dy)
pr.disable(); pstats.Stats(pr).sort_stats("tottime").print_stats(12)
