import sys, time, numpy as np
from hpcdl import backend
from hpcdl.comm import blas_threads
from hpcdl.nn import Conv2d, conv
from hpcdl.nn.model import bind_flat
blas_threads.use_layer_threads(2)
ci=co=int(sys.argv[1]); h=int(sys.argv[2])
layer = Conv2d(ci, co, 3, 1, 1, bias=False); bind_flat(layer, np, np.float32, 0)
x = np.random.default_rng(0).standard_normal((64, h, h, ci)).astype(np.float32)
dy = layer.forward(x).copy()
res={}
for rep in range(12):
    for wino in (True, False):
        for th in (1,2):
            backend.set_compute_threads(th)
            conv.winograd_faster = (lambda *a: True) if wino else (lambda *a: False)
            conv.WINOGRAD_MIN_CHANNELS = 1 if wino else 10**9
            t0=time.perf_counter(); c0=time.process_time(); layer.forward(x); layer.backward(dy); t1=time.perf_counter(); c1=time.process_time()
            assert layer.winograd==wino
            res.setdefault((wino,th),[]).append((t1-t0, c1-c0))
for k,v in res.items():
    v=np.array(v[2:]); print('winograd' if k[0] else 'im2col', 'threads',k[1], 'wall ms %.2f cpu ms %.2f'%tuple(np.median(v,axis=0)*1e3))
