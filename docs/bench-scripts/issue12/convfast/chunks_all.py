import time, numpy as np
from hpcdl.comm import blas_threads
from hpcdl.nn import Conv2d
from hpcdl.nn.model import bind_flat
import hpcdl.nn.conv as conv
blas_threads.use_layer_threads(2)
conv.MIN_CHUNK_MACS = 0
for ci, co, s, h, imgs in [(32, 32, 1, 16, [2, 3, 4, 6, 8]), (64, 64, 1, 8, [4, 7, 10, 16]), (16, 32, 2, 32, [4, 7, 10, 16]), (32, 64, 2, 16, [7, 14, 21])]:
    layer = Conv2d(ci, co, 3, s, 1, bias=False); bind_flat(layer, np, np.float32, 0)
    x = np.random.rand(64, h, h, ci).astype(np.float32); dy = np.random.rand(*layer.forward(x).shape).astype(np.float32)
    ho = layer.output_hw(h, h)[0]; img = ho * ho * 9 * ci * 4
    r = {k: [] for k in imgs}
    for rep in range(16):
        for k in imgs:
            conv.CHUNK_BYTES = k * img
            t0 = time.perf_counter(); layer.forward(x); layer.backward(dy); r[k].append(time.perf_counter() - t0)
    print(ci, co, s, h, "fwd+bwd ms by images/chunk:", " ".join(f"{k}: {np.median(v[3:])*1e3:5.2f}" for k, v in r.items()))
