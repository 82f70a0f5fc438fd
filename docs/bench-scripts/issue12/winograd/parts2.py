import sys, time, numpy as np
from hpcdl.comm import blas_threads
from hpcdl.nn import winograd as wg
blas_threads.use_layer_threads(1)
c=f=int(sys.argv[1]); h=int(sys.argv[2]); n=int(sys.argv[3])
rng=np.random.default_rng(0)
th,tw=wg.tiles(h,h); hp,wp=wg.padded_hw(h,h); W=wp-2
xpad=rng.standard_normal((n,hp,wp,c)).astype(np.float32)
bufs={}
def scratch(name, shape):
    b=bufs.get(name)
    size=int(np.prod(shape))
    if b is None or b.size<size: b=bufs[name]=np.empty(size,np.float32)
    return b[:size].reshape(shape)
u=rng.standard_normal((16,c,f)).astype(np.float32)
y=np.empty((n,h,h,f),np.float32)
T={}
def tm(name, fn, reps=40):
    fn(); ts=[]
    for _ in range(reps):
        t0=time.perf_counter(); fn(); ts.append(time.perf_counter()-t0)
    T[name]=np.median(ts)*1e6/n
along_w=scratch("along_w",(2,n,hp,W,c)); planes=scratch("planes",(2,4,n,th,W,c))
even,odd=wg._parity_masks(W,c,np.dtype(np.float32))
tm('w0', lambda: np.subtract(xpad[:,:,:W],xpad[:,:,2:],out=along_w[0]))
tm('w1 mul', lambda: np.multiply(xpad[:,:,2:],even,out=along_w[1]))
tm('w1 add', lambda: np.add(along_w[1], xpad[:,:,1:W+1], out=along_w[1]))
tm('rows', lambda: wg._input_rows([along_w[:,:,a:a+2*th:2] for a in range(4)], planes.swapaxes(0,1)))
m=scratch("m",(4,2,2,n*th*tw,f))
pos=wg._positions(planes); u5=u.reshape(4,2,2,c,f)
tm('gemm', lambda: np.matmul(pos,u5,out=m))
vc=np.ascontiguousarray(pos)
tm('gemm contig', lambda: np.matmul(vc,u5,out=m))
rs=scratch("out_rows",(2,2,2,n*th*tw,f))
tm('out rows', lambda: wg._output_rows(m,rs))
s=[rs[:,k,p] for k,p in ((0,0),(1,0),(1,1),(0,1))]
out=scratch("out_cols",(2,2,n*th*tw,f))
def oc():
    np.add(s[0], s[1], out=out[0]); out[0] += s[2]; np.subtract(s[1], s[2], out=out[1]); out[1] -= s[3]
tm('out cols', oc)
ot=out.reshape(2,2,n,th,tw,f).transpose(1,0,2,3,4,5)
tm('copy', lambda: wg._tile_view(y).__setitem__(Ellipsis, ot))
tm('forward_tiles', lambda: wg.forward_tiles(xpad,u,y,scratch))
print(c,h,n,{k:round(v,1) for k,v in T.items()}, 'us/image')
