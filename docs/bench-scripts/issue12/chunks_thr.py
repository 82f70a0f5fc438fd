"""2-core wall ms/step: A = whole batch, BLAS 2 threads; B = chunks on 2 threads, BLAS 1; C = chunks, 1 thread, BLAS 1; torch 2 threads.
argv: model rounds steps"""
import sys, time, statistics
import torch; torch.set_num_threads(2)
import threadpoolctl
from hpcdl import backend
from hpcdl.bench import compute, compute_setup
model, rounds, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
args = compute.parse_args(["--model", model, "--batch-size", "64"])
hp, _ = compute_setup.hpcdl_stepper(args); tp, _ = compute_setup.torch_stepper(args)
def setup(mode):
    if mode == "A": threadpoolctl.threadpool_limits(2, user_api="blas"); backend.set_blas_threads(None); backend.set_compute_threads(1)
    if mode == "B": threadpoolctl.threadpool_limits(1, user_api="blas"); backend.set_blas_threads(1); backend.set_compute_threads(2)
    if mode == "C": threadpoolctl.threadpool_limits(1, user_api="blas"); backend.set_blas_threads(1); backend.set_compute_threads(1)
def run(mode):
    if mode == "torch":
        f = tp
    else:
        setup(mode); f = hp
    for _ in range(2): f()
    ts = []
    for _ in range(steps):
        a = time.perf_counter(); f(); ts.append(time.perf_counter() - a)
    return statistics.median(ts) * 1e3
for r in range(rounds):
    res = {m: run(m) for m in ("A", "B", "C", "torch")}
    load = open("/proc/loadavg").read().split()[0]
    print(model, " ".join(f"{k} {v:.1f}" for k, v in res.items()), f"B/A {res['B']/res['A']:.2f} B/torch {res['B']/res['torch']:.2f} A/torch {res['A']/res['torch']:.2f} load {load}", flush=True)
