import time, numpy as np, sys
from hpcdl import backend
from hpcdl.nn import threads
threads.MIN_SPLIT_ELEMENTS = 1
def relu(x, y, mask):
    def w(f, c, p):
        np.maximum(x[f:f+c], 0, out=y[f:f+c]); np.greater(y[f:f+c], 0, out=mask[f:f+c])
    threads.run_split(x.shape[0], w, x)
for n in [1<<16, 1<<17, 1<<18, 1<<19, 1<<20]:
    x = np.random.rand(64, n//64).astype(np.float32) - 0.5; y = np.empty_like(x); m = np.empty(x.shape, bool)
    res = []
    for t in (1, 2):
        backend.set_compute_threads(t)
        for _ in range(20): relu(x, y, m)
        ts = []
        for _ in range(200):
            t0 = time.perf_counter(); relu(x, y, m); ts.append(time.perf_counter() - t0)
        res.append(np.median(ts) * 1e3)
    print(n, " ".join(f"{r:.3f}" for r in res))
