"""Per-conv-shape fwd / bwd ms, before (main HEAD conv.py) vs after (worktree), alternated per rep
in one process (batch 64, float32, one BLAS thread, 2 compute threads)."""
import importlib.util, sys, time, numpy as np
from hpcdl.comm import blas_threads
from hpcdl.nn.conv import Conv2d as After
from hpcdl.nn.model import bind_flat
spec = importlib.util.spec_from_file_location("conv_before", "/tmp/convfast-before/hpcdl/nn/conv.py")
mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
Before = mod.Conv2d
spec2 = importlib.util.spec_from_file_location("conv_dyn", "/tmp/convfast/conv_dyn.py"); mod2 = importlib.util.module_from_spec(spec2); spec2.loader.exec_module(mod2)
blas_threads.use_layer_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
rng = np.random.default_rng(0)
cases = [("r 3->16 32", 3, 16, 1, 1, 32, 1), ("r 16->16 32", 16, 16, 1, 1, 32, 6),
         ("r 16->32 s2", 16, 32, 2, 1, 32, 1), ("r 32->32 16", 32, 32, 1, 1, 16, 5),
         ("r 32->64 s2", 32, 64, 2, 1, 16, 1), ("r 64->64 8", 64, 64, 1, 1, 8, 5),
         ("c 3->32 32", 3, 32, 1, 1, 32, 1), ("c 32->32 v", 32, 32, 1, 0, 32, 1),
         ("c 32->64 15", 32, 64, 1, 1, 15, 1), ("c 64->64 v", 64, 64, 1, 0, 15, 1)]
tot = {}
for name, ci, co, s, p, h, cnt in cases:
    layers = {}
    for side, cls in (("before", Before), ("dyn", mod2.Conv2d), ("after", After)):
        layer = cls(ci, co, 3, s, p, bias=name[0] == "c"); bind_flat(layer, np, np.float32, 0)
        layer.input_grad = ci != 3; layers[side] = layer
    x = rng.standard_normal((64, h, h, ci)).astype(np.float32)
    dy = rng.standard_normal(layers["after"].forward(x).shape).astype(np.float32)
    t = {side: ([], []) for side in layers}
    for rep in range(24):
        for side, layer in layers.items():
            t0 = time.perf_counter(); layer.forward(x); t1 = time.perf_counter(); layer.backward(dy); t2 = time.perf_counter()
            t[side][0].append(t1 - t0); t[side][1].append(t2 - t1)
    line = name.ljust(13)
    for side, (f, b) in t.items():
        mf, mb = np.median(f[4:]) * 1e3, np.median(b[4:]) * 1e3
        key = (name[0], side); a = tot.setdefault(key, [0.0, 0.0]); a[0] += cnt * mf; a[1] += cnt * mb
        line += f" {side} {mf:6.2f} {mb:6.2f} |"
    print(line)
for (m, side), (f, b) in tot.items():
    print(f"total {m} {side:6s}: fwd {f:6.1f} bwd {b:6.1f}")
