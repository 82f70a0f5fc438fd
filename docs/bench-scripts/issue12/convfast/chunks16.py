import time, numpy as np
from hpcdl.comm import blas_threads
from hpcdl.nn import Conv2d
from hpcdl.nn.model import bind_flat
import hpcdl.nn.conv as conv
blas_threads.use_layer_threads(2)
img = 32 * 32 * 144 * 4
layer = Conv2d(16, 16, 3, 1, 1, bias=False); bind_flat(layer, np, np.float32, 0)
x = np.random.rand(64, 32, 32, 16).astype(np.float32); dy = np.random.rand(64, 32, 32, 16).astype(np.float32)
imgs = [1, 2, 3, 4, 6]
r = {k: [] for k in imgs}
for rep in range(20):
    for k in imgs:
        conv.CHUNK_BYTES = k * img
        t0 = time.perf_counter(); layer.forward(x); layer.backward(dy); r[k].append(time.perf_counter() - t0)
print("16->16 32x32 fwd+bwd ms by images per chunk:", " ".join(f"{k}: {np.median(v[3:])*1e3:6.2f}" for k, v in r.items()))
