"""In one process, turns of: A = only convolutions split (elementwise layers on one thread, as
main), B = this branch (threshold 512K), C = threshold 256K, torch. Median ms per step."""
import sys, argparse, numpy as np
from hpcdl.bench import compute, compute_setup
from hpcdl.nn import threads
model, steps, chunk = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
args = compute.parse_args(["--model", model, "--batch-size", "64"])
compute_setup.set_threads("cpu")
def with_threshold(stepper, minimum):
    step, sync = stepper
    def run():
        threads.MIN_SPLIT_ELEMENTS = minimum
        step()
    return run, sync
steppers = [with_threshold(compute_setup.hpcdl_stepper(args), m) for m in (1 << 62, 1 << 19, 1 << 18)]
steppers.append(compute_setup.torch_stepper(args))
times = compute.time_interleaved(steppers, steps, chunk)
med = [float(np.median(t)) * 1e3 for t in times]
load = open("/proc/loadavg").read().split()[0]
print(f"{model} A {med[0]:.1f} B {med[1]:.1f} C {med[2]:.1f} torch {med[3]:.1f} B/A {med[1]/med[0]:.3f} C/A {med[2]/med[0]:.3f} load {load}", flush=True)
