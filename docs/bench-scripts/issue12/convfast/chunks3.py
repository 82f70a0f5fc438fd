import time, numpy as np
from hpcdl.comm import blas_threads
from hpcdl.nn import Conv2d
from hpcdl.nn.model import bind_flat
import hpcdl.nn.conv as conv
blas_threads.use_layer_threads(2)
layer = Conv2d(3, 16, 3, 1, 1, bias=False); bind_flat(layer, np, np.float32, 0); layer.input_grad = False
x = np.random.rand(64, 32, 32, 3).astype(np.float32); dy = np.random.rand(64, 32, 32, 16).astype(np.float32)
img = 1024 * 27 * 4
r = {k: [] for k in (9, 14)}
for rep in range(30):
    for k in r:
        conv.CHUNK_BYTES = k * img; conv.MIN_CHUNK_MACS = 0
        t0 = time.perf_counter(); layer.forward(x); layer.backward(dy); r[k].append(time.perf_counter() - t0)
print("3->16 fwd+bwd ms by images per chunk:", {k: round(np.median(v[3:]) * 1e3, 2) for k, v in r.items()})
