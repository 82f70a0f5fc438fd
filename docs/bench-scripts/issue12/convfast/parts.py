import time, numpy as np
from hpcdl.comm import blas_threads
blas_threads.use_layer_threads(1)
from hpcdl.nn.conv import _windows
def t(f, n=200):
    for _ in range(10): f()
    t0 = time.perf_counter()
    for _ in range(n): f()
    return (time.perf_counter() - t0) / n * 1e6
for c, f_, h, imgs in [(16, 16, 32, 1), (16, 16, 32, 4), (32, 32, 16, 4), (64, 64, 8, 16), (32,32,32,1)]:
    xp_ = np.random.rand(imgs, h + 2, h + 2, c).astype(np.float32)
    cols = np.empty((imgs, h, h, 3, 3, c), np.float32)
    W = np.random.rand(9 * c, f_).astype(np.float32)
    y = np.empty((imgs * h * h, f_), np.float32)
    dW = np.empty_like(W)
    c2 = cols.reshape(imgs * h * h, -1)
    def im(): cols[...] = _windows(np, xp_, h, h, 3, 3, 1, 1)
    # row-wise copy: 3 copies of (imgs,h,h,3c) runs
    def im3():
        for i in range(3):
            cols.reshape(imgs, h, h, 3, 3 * c)[:, :, :, i] = np.lib.stride_tricks.as_strided(xp_[:, i:], shape=(imgs, h, h, 3 * c), strides=(xp_.strides[0], xp_.strides[1], xp_.strides[2], 4))
    def gemm(): np.matmul(c2, W, out=y)
    def gemmw(): np.matmul(c2.T, y, out=dW)
    Wt = np.ascontiguousarray(W.T)
    dc = np.empty_like(c2)
    def gemmt(): np.matmul(y, Wt, out=dc)
    im3(); a = cols.copy(); im(); assert (a == cols).all()
    print(f"c{c} f{f_} h{h} imgs{imgs} cols {c2.nbytes/1e6:.2f}MB: im2col {t(im):7.1f} im3 {t(im3):7.1f} gemm {t(gemm):7.1f} dW {t(gemmw):7.1f} dcols {t(gemmt):7.1f} us")
