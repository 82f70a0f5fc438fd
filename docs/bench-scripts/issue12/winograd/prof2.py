import sys, time, numpy as np
from hpcdl.comm import blas_threads
from hpcdl.nn import winograd as wg
blas_threads.use_layer_threads(1)
np.setbufsize(512)
c=f=int(sys.argv[1]); h=int(sys.argv[2]); n=int(sys.argv[3])
rng=np.random.default_rng(0)
th,tw=wg.tiles(h,h); hp,wp=wg.padded_hw(h,h)
xpad=rng.standard_normal((n,hp,wp,c)).astype(np.float32)
bufs={}
def scratch(name, shape):
    b=bufs.get(name); size=int(np.prod(shape))
    if b is None or b.size<size: b=bufs[name]=np.empty(size,np.float32)
    return b[:size].reshape(shape)
u=rng.standard_normal((16,c,f)).astype(np.float32); ut=wg.input_grad_weight(u)
y=np.empty((n,h,h,f),np.float32); dy=rng.standard_normal(y.shape).astype(np.float32)
du=np.empty((16,c,f),np.float32); dx=np.empty_like(xpad)
# wrap functions with timers
T={}
def wrap(name):
    fn=getattr(wg,name)
    def w(*a,**k):
        t0=time.perf_counter(); r=fn(*a,**k); T[name]=T.get(name,0)+time.perf_counter()-t0; return r
    setattr(wg,name,w)
for nm in ['_input_planes','_output_rows','_output_grad_planes','_input_grad','_input_rows','_input_grad_rows','_overlap_add']: wrap(nm)
mm=np.matmul
def mmw(*a,**k):
    t0=time.perf_counter(); r=mm(*a,**k); T['matmul']=T.get('matmul',0)+time.perf_counter()-t0; return r
wg.np.matmul=mmw
reps=30
for _ in range(3): wg.forward_tiles(xpad,u,y,scratch); wg.backward_tiles(xpad,dy,ut,du,dx,scratch)
T.clear()
t0=time.perf_counter()
for _ in range(reps): wg.forward_tiles(xpad,u,y,scratch)
tf=time.perf_counter()-t0
Tf=dict(T); T.clear()
t0=time.perf_counter()
for _ in range(reps): wg.backward_tiles(xpad,dy,ut,du,dx,scratch)
tb=time.perf_counter()-t0
sc=1e6/reps/n
print('fwd total', round(tf*sc,1), {k:round(v*sc,1) for k,v in Tf.items()})
print('bwd total', round(tb*sc,1), {k:round(v*sc,1) for k,v in T.items()})
