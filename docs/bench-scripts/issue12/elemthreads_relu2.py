import time, numpy as np
from hpcdl import backend
from hpcdl.nn import ReLU, Dropout
x = np.random.default_rng(0).standard_normal((64, 32, 32, 16)).astype(np.float32)
out = []
for make in (ReLU, lambda: Dropout(0.25)):
    for t in (1, 2):
        backend.set_compute_threads(t); layer = make()
        ts = []
        for _ in range(60):
            t0 = time.perf_counter(); layer.backward(layer.forward(x)); ts.append(time.perf_counter() - t0)
        out.append(np.median(ts[10:]) * 1e3)
print(" ".join(f"{v:.3f}" for v in out), open("/proc/loadavg").read().split()[0])
