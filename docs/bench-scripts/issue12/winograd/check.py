import numpy as np
from hpcdl import backend
from hpcdl.nn import Conv2d, conv
from hpcdl.nn.model import bind_flat
backend.set_blas_threads(1)
rng=np.random.default_rng(0)
def run(layer,x,dy,wino):
    conv.winograd_faster = (lambda *a: True) if wino else (lambda *a: False)
    y=layer.forward(x).copy(); assert layer.winograd==wino
    layer.g["W"][...]=np.nan
    dx=layer.backward(dy); dx = None if dx is None else dx.copy()
    return y,dx,{k:v.copy() for k,v in layer.g.items()}
for threads in (1,2):
  backend.set_compute_threads(threads)
  for (ci,co,p,n,h,w,bias) in [(4,6,1,5,7,9,True),(8,8,0,3,9,8,False),(16,16,1,64,32,32,True),(5,3,1,1,6,5,True)]:
    l=Conv2d(ci,co,3,padding=p,bias=bias); bind_flat(l,np,np.float64,seed=1)
    x=rng.standard_normal((n,h,w,ci)); dy=rng.standard_normal(l.forward(x).shape)
    a=run(l,x,dy,True); b=run(l,x,dy,False)
    rel=lambda u,v: np.abs(u-v).max()/np.abs(v).max()
    print(threads, ci,co,p,n,h,w,'chunk',l.chunk, rel(a[0],b[0]), rel(a[1],b[1]), {k:rel(a[2][k],b[2][k]) for k in a[2]})
