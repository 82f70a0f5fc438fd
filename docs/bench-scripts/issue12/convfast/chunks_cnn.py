import time, numpy as np
from hpcdl.comm import blas_threads
from hpcdl.nn import Conv2d
from hpcdl.nn.model import bind_flat
import hpcdl.nn.conv as conv
blas_threads.use_layer_threads(2)
for ci, co, h, pad in [(32, 32, 32, 0), (64, 64, 15, 0)]:
    layer = Conv2d(ci, co, 3, 1, pad); bind_flat(layer, np, np.float32, 0)
    x = np.random.rand(64, h, h, ci).astype(np.float32); dy = np.random.rand(*layer.forward(x).shape).astype(np.float32)
    ho = h + 2 * pad - 2; img = ho * ho * 9 * ci * 4
    imgs = [1, 2, 3, 4]
    r = {k: [] for k in imgs}
    for rep in range(14):
        for k in imgs:
            conv.CHUNK_BYTES = k * img
            t0 = time.perf_counter(); layer.forward(x); layer.backward(dy); r[k].append(time.perf_counter() - t0)
    print(ci, co, h, pad, "fwd+bwd ms by images per chunk:", " ".join(f"{k}: {np.median(v[3:])*1e3:6.2f}" for k, v in r.items()))
