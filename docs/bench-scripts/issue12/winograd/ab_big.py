"""resnet18-at-224 3x3 stride-1 shapes, batch 8, one BLAS thread, one chunk thread: im2col vs Winograd
alternated per rep, fwd / bwd ms."""
import sys, time, numpy as np
from hpcdl.comm import blas_threads
from hpcdl.nn import Conv2d, conv
from hpcdl.nn.model import bind_flat
blas_threads.use_layer_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 1)
conv.WINOGRAD_THREADED_MIN_CHANNELS = 1
conv.WINOGRAD_THREADED_MIN_SIZE = 1
rng = np.random.default_rng(0)
for c, h in [(64, 56), (128, 28), (256, 14), (512, 7)]:
    layer = Conv2d(c, c, 3, 1, 1, bias=False); bind_flat(layer, np, np.float32, 0)
    x = rng.standard_normal((8, h, h, c)).astype(np.float32)
    dy = rng.standard_normal((8, h, h, c)).astype(np.float32)
    t = {s: ([], []) for s in ("im2col", "winograd")}
    for rep in range(int(sys.argv[1]) if len(sys.argv) > 1 else 6):
        for side in t:
            conv.WINOGRAD_MIN_CHANNELS = 1 if side == "winograd" else 10**9
            t0 = time.perf_counter(); layer.forward(x); t1 = time.perf_counter(); layer.backward(dy); t2 = time.perf_counter()
            t[side][0].append(t1 - t0); t[side][1].append(t2 - t1)
    print(f"{c}->{c} {h}x{h}", " | ".join(f"{s} {np.median(f[1:])*1e3:7.2f} {np.median(b[1:])*1e3:7.2f}" for s, (f, b) in t.items()), "chunk", layer.chunk, flush=True)
