"""Open MPI over the emulated link, 2 ranks: 25 MiB one way, both ways at once, Allreduce."""
import time, numpy as np
from mpi4py import MPI
c = MPI.COMM_WORLD
n = 25 * (1 << 20) // 4
a = np.ones(n, np.float32); b = np.empty_like(a)
def uni():
    if c.rank == 0: c.Send(a, 1)
    else: c.Recv(b, 0)
def bi():
    c.Sendrecv(a, 1 - c.rank, recvbuf=b, source=1 - c.rank)
def flat(): c.Allreduce(MPI.IN_PLACE, a, op=MPI.SUM)
for name, f in (("uni 25MiB", uni), ("bi 25MiB each way", bi), ("flat allreduce 25MiB", flat)):
    f(); c.Barrier(); t = time.perf_counter()
    for _ in range(3): f()
    c.Barrier()
    t = (time.perf_counter() - t) / 3
    if c.rank == 0: print(f"{name}: {t*1e3:.0f} ms", flush=True)
