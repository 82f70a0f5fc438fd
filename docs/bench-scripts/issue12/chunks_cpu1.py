"""Single-thread CPU time per step, hpcdl vs torch, same process. argv: model steps [chunk_mb]."""
import sys, time, statistics
import torch; torch.set_num_threads(1)
import hpcdl
from hpcdl import backend
from hpcdl.bench import compute, compute_setup
if hasattr(backend, "set_blas_threads"):
    backend.set_blas_threads(1)  # what hpcdl.train's blas_threads.apply(1) records
    if len(sys.argv) > 3:
        from hpcdl.nn import conv; conv.CHUNK_BYTES = int(float(sys.argv[3]) * (1 << 20))
args = compute.parse_args(["--model", sys.argv[1], "--batch-size", "64"])
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 10
st = [compute_setup.hpcdl_stepper(args), compute_setup.torch_stepper(args)]
for s, _ in st:
    for _ in range(3): s()
res = [[], []]
for r in range(steps):
    for (s, _), out in zip(st, res):
        a = time.process_time(); s(); out.append(time.process_time() - a)
h, t = (statistics.median(x) * 1e3 for x in res)
with open("/proc/loadavg") as f: load = f.read().split()[0]
print(f"{sys.argv[1]} 1-thread CPU ms/step: hpcdl {h:.1f} torch {t:.1f} ratio {h/t:.2f} load {load} ({hpcdl.__file__}) {sys.argv[3:]}")
