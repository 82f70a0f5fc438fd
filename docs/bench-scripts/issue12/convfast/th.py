import time, sys, numpy as np
from hpcdl import backend
from hpcdl.comm import blas_threads
from hpcdl.nn import Conv2d
from hpcdl.nn.model import bind_flat
import hpcdl.nn.conv as conv
blas_threads.use_layer_threads(2)
for ci,h in [(16,32),(32,16),(64,8)]:
    layer = Conv2d(ci, ci, 3, 1, 1, bias=False); bind_flat(layer, np, np.float32, 0)
    x = np.random.rand(64,h,h,ci).astype(np.float32); dy = np.random.rand(64,h,h,ci).astype(np.float32)
    keys = [(1, 1<<20), (2, 1<<20), (2, 1<<21), (2, 1<<22)]
    r = {k: ([],[]) for k in keys}
    for rep in range(20):
        for k in keys:
            backend.set_compute_threads(k[0]); conv.CHUNK_BYTES = k[1]
            t0=time.perf_counter(); layer.forward(x); t1=time.perf_counter(); layer.backward(dy); t2=time.perf_counter()
            r[k][0].append(t1-t0); r[k][1].append(t2-t1)
    print(ci, h, {f"{th}t {cb>>20}MB": (round(np.median(a[3:])*1e3,2), round(np.median(b[3:])*1e3,2)) for (th,cb),(a,b) in r.items()})
