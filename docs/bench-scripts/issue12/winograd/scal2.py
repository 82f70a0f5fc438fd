import sys, time, numpy as np
from hpcdl import backend
from hpcdl.comm import blas_threads
from hpcdl.nn import Conv2d, conv
from hpcdl.nn.model import bind_flat
blas_threads.use_layer_threads(2)
ci=co=int(sys.argv[1]); h=int(sys.argv[2])
if len(sys.argv) > 3: conv.WINOGRAD_CHUNK_BYTES = int(sys.argv[3])
layer = Conv2d(ci, co, 3, 1, 1, bias=False); bind_flat(layer, np, np.float32, 0)
x = np.random.default_rng(0).standard_normal((64, h, h, ci)).astype(np.float32)
dy = layer.forward(x).copy()
res={}
for rep in range(14):
    for wino in (True, False):
        conv.WINOGRAD_MIN_CHANNELS = conv.WINOGRAD_THREADED_MIN_CHANNELS = 1 if wino else 10**9
        conv.WINOGRAD_THREADED_MIN_SIZE = 1
        for th in (1,2):
            backend.set_compute_threads(th)
            t0=time.perf_counter(); layer.forward(x); t1=time.perf_counter(); layer.backward(dy); t2=time.perf_counter()
            res.setdefault((wino,th),[]).append((t1-t0, t2-t1))
for k,v in res.items():
    v=np.array(v[2:]); print('winograd' if k[0] else 'im2col  ', 'threads',k[1], 'fwd %.2f bwd %.2f ms'%tuple(np.median(v,axis=0)*1e3), 'chunk', layer.chunk)
