import time, numpy as np
from hpcdl.nn import threads
def noop(p): pass
for _ in range(3):
    ts=[]
    for _ in range(2000):
        t0=time.perf_counter(); threads.run_parts(2, noop); ts.append(time.perf_counter()-t0)
    print("run_parts(2, noop) median us", np.median(ts)*1e6, "p10", np.percentile(ts,10)*1e6)
