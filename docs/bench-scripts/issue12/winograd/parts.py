import sys, time, numpy as np
from hpcdl.comm import blas_threads
from hpcdl.nn import winograd as wg
blas_threads.use_layer_threads(1)
def tm(f, reps=30):
    ts=[]
    for _ in range(reps):
        t0=time.perf_counter(); f(); ts.append(time.perf_counter()-t0)
    return np.median(ts)*1e6
for (c,f,h,n) in [(16,16,32,4),(32,32,16,8),(64,64,8,16)]:
    rng=np.random.default_rng(0)
    ho=h; th,tw=wg.tiles(ho,ho); hp,wp=wg.padded_hw(ho,ho)
    xpad=rng.standard_normal((n,hp,wp,c)).astype(np.float32)
    rows=np.empty((4,n,th,wp,c),np.float32); v=np.empty((4,4,n,th,tw,c),np.float32)
    u=rng.standard_normal((16,c,f)).astype(np.float32); m=np.empty((4,4,n,th,tw,f),np.float32)
    y=np.empty((n,ho,ho,f),np.float32); orow=np.empty((2,4,n,th,tw,f),np.float32)
    cols=np.empty((n,ho,ho,3,3,c),np.float32); w2=rng.standard_normal((9*c,f)).astype(np.float32)
    from hpcdl.nn.conv import _windows
    r={}
    r['in rows']=tm(lambda: wg._input_rows([xpad[:, a : a + 2 * th : 2] for a in range(4)], rows))
    r['in cols']=tm(lambda: wg._input_rows([rows[:, :, :, b : b + 2 * tw : 2] for b in range(4)], v.swapaxes(0,1)))
    r['gemm']=tm(lambda: np.matmul(v.reshape(16,-1,c),u,out=m.reshape(16,-1,f)))
    r['out rows']=tm(lambda: wg._output_rows(m, orow))
    r['out cols']=tm(lambda: wg._output_rows(orow.swapaxes(0,1), wg._tile_view(y).swapaxes(0,1)))
    r['im2col']=tm(lambda: cols.__setitem__(Ellipsis, _windows(np, xpad[:, :ho+2, :ho+2], ho, ho, 3,3,1,1)))
    r['im2col gemm']=tm(lambda: np.matmul(cols.reshape(-1,9*c), w2))
    print(c, f, h, n, {k: round(v_/n,1) for k,v_ in r.items()}, 'us/image')
