import time, numpy as np
from hpcdl.comm import blas_threads
blas_threads.use_layer_threads(2)
from hpcdl.nn.threads import run_parts
from hpcdl.nn.conv import _windows
def mk(imgs, c, h):
    xp_ = np.random.rand(imgs, h + 2, h + 2, c).astype(np.float32)
    cols = np.empty((imgs, h, h, 3, 3, c), np.float32); W = np.random.rand(9*c, c).astype(np.float32)
    y = np.empty((imgs*h*h, c), np.float32); return xp_, cols, W, y
for c, h, imgs in [(16,32,1),(16,32,4),(32,16,3),(64,8,7)]:
    bufs = [mk(imgs, c, h) for _ in range(2)]
    def im(s):
        xp_, cols, W, y = bufs[s]
        for _ in range(40): cols[...] = _windows(np, xp_, h, h, 3, 3, 1, 1)
    def gm(s):
        xp_, cols, W, y = bufs[s]; c2 = cols.reshape(y.shape[0], -1)
        for _ in range(40): np.matmul(c2, W, out=y)
    for name, f in (("im2col", im), ("gemm", gm)):
        res = []
        for parts in (1, 2, 1, 2):
            t0 = time.perf_counter(); run_parts(parts, f); res.append((time.perf_counter()-t0)/parts)
        print(c, h, imgs, name, "per-task ms 1 thread %.2f %.2f  2 threads %.2f %.2f" % (res[0]*1e3/40*1e3/1e3, res[2]*1e3/40, res[1]*1e3/40, res[3]*1e3/40))
