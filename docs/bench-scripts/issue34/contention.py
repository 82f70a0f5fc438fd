"""A 25 MiB allreduce beside matrix products on the same core: blocking Allreduce (flat) or
Iallreduce tested every 0.2 ms (nb); argv[1]: flat or nb. Run by run_contention.py."""
import os, threading, time, numpy as np, sys, torch
from mpi4py import MPI
torch.set_num_threads(1)
c = MPI.COMM_WORLD
mode = sys.argv[1]
n = 25 * (1 << 20) // 4
a = np.ones(n, dtype=np.float32)
def reduce_once():
    if mode == "flat":
        c.Allreduce(MPI.IN_PLACE, a, op=MPI.SUM)
    else:
        r = c.Iallreduce(MPI.IN_PLACE, a, op=MPI.SUM)
        while not r.Test(): time.sleep(0.0002)
x = torch.randn(512, 512)
def compute(stop, count):
    while not stop.is_set():
        torch.mm(x, x); count[0] += 1
res = []
for rep in range(4):
    stop = threading.Event(); count = [0]
    c.Barrier()
    th = threading.Thread(target=compute, args=(stop, count)); th.start()
    t = time.perf_counter(); reduce_once(); reduce_once(); t = time.perf_counter() - t
    stop.set(); th.join()
    res.append((t / 2, count[0] / (2 * t) if t else 0))
# compute alone rate
stop = threading.Event(); count = [0]
th = threading.Thread(target=compute, args=(stop, count)); th.start(); time.sleep(1); stop.set(); th.join()
if c.rank == 0:
    ar = sorted(r[0] for r in res[1:])[1]
    rate = sorted(r[1] for r in res[1:])[1]
    print(f"{mode} {os.environ.get('TAG','')}: allreduce {ar*1e3:.0f} ms per 25 MiB while computing; compute {rate:.0f} mm/s-per-reduce-s vs alone {count[0]:.0f}/s", flush=True)
