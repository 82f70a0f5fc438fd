import time, numpy as np
from hpcdl.comm import blas_threads
blas_threads.use_layer_threads(1)
from hpcdl.nn.conv import _windows
def t(f, n=60):
    for _ in range(5): f()
    t0 = time.perf_counter()
    for _ in range(n): f()
    return (time.perf_counter() - t0) / n * 1e6
for c, f_, h in [(16, 16, 32), (32, 32, 16), (64, 64, 8)]:
    for imgs in (1, 2, 4, 8, 16):
        xp_ = np.random.rand(imgs, h + 2, h + 2, c).astype(np.float32)
        cols = np.empty((imgs, h, h, 3, 3, c), np.float32)
        W = np.random.rand(9 * c, f_).astype(np.float32)
        y = np.empty((imgs * h * h, f_), np.float32); yT = np.empty((f_, imgs*h*h), np.float32)
        dW = np.empty_like(W); dWT = np.empty((f_, 9*c), np.float32)
        c2 = cols.reshape(imgs * h * h, -1)
        def fw(): cols[...] = _windows(np, xp_, h, h, 3, 3, 1, 1); np.matmul(c2, W, out=y)
        def fwT(): cols[...] = _windows(np, xp_, h, h, 3, 3, 1, 1); np.matmul(W.T, c2.T, out=yT)
        def bw(): cols[...] = _windows(np, xp_, h, h, 3, 3, 1, 1); np.matmul(c2.T, y, out=dW)
        def bwT(): cols[...] = _windows(np, xp_, h, h, 3, 3, 1, 1); np.matmul(y.T, c2, out=dWT)
        r = [t(g) / imgs for g in (fw, fwT, bw, bwT)]
        print(f"c{c} h{h} imgs{imgs:2d} {c2.nbytes/1e6:5.2f}MB per img: fwd {r[0]:6.1f} fwdT {r[1]:6.1f} dW {r[2]:6.1f} dWT {r[3]:6.1f}")
