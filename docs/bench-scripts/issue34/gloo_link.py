"""gloo (PyTorch DDP's backend) allreduce of 25 MiB between 2 ranks; ADDR: rank 0's address."""
import time, os, torch, torch.distributed as dist
from mpi4py import MPI
c = MPI.COMM_WORLD
addr = c.bcast(os.environ["ADDR"])
dist.init_process_group("gloo", init_method=f"tcp://{addr}:29555", rank=c.rank, world_size=c.size)
t = torch.ones(25 * (1 << 20) // 4)
dist.all_reduce(t)
c.Barrier(); s = time.perf_counter()
for _ in range(3): dist.all_reduce(t)
c.Barrier()
if c.rank == 0: print(f"gloo allreduce 25MiB: {(time.perf_counter()-s)/3*1e3:.0f} ms", flush=True)
