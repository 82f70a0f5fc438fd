"""The GPU path of what waves 2 and 3 added, on CuPy and a real GPU (scripts/gpu-check.sh).

SyncBatchNorm across MPI ranks that share the GPU, AdamW, an fp16 step that overflows, the
reducer's per-bucket events (no stream-wide wait), the doctor's GPU facts and a job script
rendered with --device gpu. The cupy-parametrised layer, model and precision tests elsewhere
(`-m gpu`) and hpcdl.torch.Loader's pinned batches (tests/test_torch_loader.py) complete the set.
Every test here skips, with one reason, where CuPy sees no GPU (CI).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
from helpers import BIN, mpi_env

from hpcdl import nn
from hpcdl.backend import cupy_or_none, to_host

cp = cupy_or_none()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(cp is None, reason="needs CuPy and a GPU")]

SHAPE, CLASSES, B, STEPS = (3, 8, 8), 10, 4, 3


def _batch(step: int, ranks: int):
    rng = np.random.default_rng(step)
    x = rng.standard_normal((ranks * B, *SHAPE)) * 2.0 + 0.5  # a mean to normalise away
    return cp.asarray(x), cp.asarray(rng.integers(0, CLASSES, ranks * B))


def _resnet():
    return nn.build_model("resnet20", SHAPE, CLASSES, seed=5, xp=cp, dtype=np.float64)


def _rel(a, b) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.mpi(min_size=2)
def test_sync_bn_ranks_sharing_the_gpu_match_one_rank_with_the_joined_batch():
    """R MPI ranks on one GPU, batch B each, SyncBatchNorm and the gradient reducer on CuPy
    buffers (through host memory where the MPI is not CUDA-aware) equal one rank of R*B."""
    from mpi4py import MPI

    from hpcdl.comm import cuda_aware
    from hpcdl.comm.collectives import SumReducer
    from hpcdl.comm.reducer import GradientReducer

    comm = MPI.COMM_WORLD
    size, rank = comm.Get_size(), comm.Get_rank()
    via_host = not cuda_aware.detect(comm, "gpu").aware
    reference = _resnet()
    ref_opt = nn.make_optimizer("sgd", reference.params, reference.grads, momentum=0.9)
    model = _resnet()
    opt = nn.make_optimizer("sgd", model.params, model.grads, momentum=0.9)
    stats = SumReducer(comm, host_staged=via_host)
    model.set_stat_reducer(stats)
    grads = GradientReducer(comm, model.grads, bucket_mb=0.05, host_staged=via_host, prescaled=True)
    try:
        for step in range(STEPS):
            x, y = _batch(step, size)
            _, d = nn.softmax_cross_entropy(reference.forward(x, train=True), y)
            reference.backward(d)
            ref_opt.step(0.1)
            mine = slice(rank * B, (rank + 1) * B)
            grads.begin_step()
            _, d = nn.softmax_cross_entropy(model.forward(x[mine], train=True), y[mine])
            model.backward(d / size, grad_ready=grads.mark_ready)
            grads.wait()
            opt.step(0.1)
    finally:
        grads.close()
        stats.close()
    outcome = (
        _rel(to_host(model.params), to_host(reference.params)),
        _rel(to_host(model.buffers), to_host(reference.buffers)),
    )
    outcomes = comm.allgather(outcome)  # every rank asserts on every rank's outcome
    assert all(p < 1e-10 and b < 1e-10 for p, b in outcomes), outcomes


def test_adamw_on_the_gpu_is_the_numpy_update():
    rng = np.random.default_rng(0)
    start = rng.standard_normal(10_001)
    updates = []
    for xp in (np, cp):
        params = xp.asarray(start.copy())
        grads = xp.zeros_like(params)
        opt = nn.make_optimizer("adamw", params, grads, weight_decay=0.05)
        for step in range(20):
            grads[...] = xp.asarray(np.random.default_rng(step + 1).standard_normal(start.size))
            opt.step(0.003)
        updates.append(to_host(params))
    np.testing.assert_allclose(updates[1], updates[0], rtol=1e-12, atol=1e-15)
    assert not np.allclose(updates[0], start)


def test_fp16_overflow_skips_the_step_on_the_gpu_then_trains():
    from hpcdl.nn.precision import LossScaler
    from hpcdl.nn.step import StepParts, train_step

    model = nn.build_model("cnn", (1, 8, 8), 10, seed=3, xp=cp)
    model.set_precision("fp16")
    opt = nn.make_optimizer("sgd", model.params, model.grads, momentum=0.9)
    scaler = LossScaler(init_scale=2.0**40)  # scaled gradients overflow fp16's 65504
    parts = StepParts(model, opt, cp, scaler=scaler)
    rng = np.random.default_rng(0)
    x = cp.asarray(rng.standard_normal((16, 1, 8, 8)).astype(np.float32))
    y = cp.asarray(rng.integers(0, 10, 16))
    before = model.params.copy()
    skipped = 0
    while not train_step(parts, x, y, lr=0.1).applied:
        skipped += 1
        assert bool((model.params == before).all())
    assert skipped >= 10 and scaler.skipped == skipped
    assert scaler.scale == 2.0**40 / 2**skipped
    assert not bool((model.params == before).all())
    assert bool(cp.isfinite(model.params).all())


def test_reducer_waits_for_its_buckets_only_not_for_the_whole_device():
    """While an unrelated stream runs long kernels, wait() returns once the buckets' own work
    and allreduces are done: it synchronises per-bucket events and its own stream, never the
    device or the default stream."""
    from mpi4py import MPI

    from hpcdl.comm.reducer import GradientReducer

    busy = cp.cuda.Stream(non_blocking=True)
    compute = cp.cuda.Stream(non_blocking=True)
    a = cp.random.default_rng(1).standard_normal((4096, 4096), dtype=cp.float32)
    grads = cp.zeros(3 * (1 << 18), dtype=cp.float32)
    reducer = GradientReducer(MPI.COMM_SELF, grads, 1.0, host_staged=True)
    try:
        with busy:
            for _ in range(400):  # about a second of matrix products on an H100
                a = a @ a
                a *= 1e-3
            busy_done = cp.cuda.Event(disable_timing=True)
            busy_done.record()
        reducer.begin_step()
        with compute:
            for bucket in reducer.buckets:
                grads[bucket.lo : bucket.hi] = bucket.index + 1
                reducer.mark_ready(bucket.hi)
        t0 = time.perf_counter()
        reducer.wait()
        waited = time.perf_counter() - t0
        still_busy = not busy_done.done
        busy.synchronize()
    finally:
        reducer.close()
    assert still_busy, f"wait() took {waited:.3f} s and outlasted the unrelated stream's work"
    for bucket in reducer.buckets:
        assert bool((grads[bucket.lo : bucket.hi] == bucket.index + 1).all())


def test_doctor_states_the_gpu_it_would_bind(tmp_path):
    env = {**mpi_env(), "OMP_NUM_THREADS": "1"}
    env.pop("HPCDL_CUDA_AWARE", None)
    proc = subprocess.run(
        [sys.executable, "-m", "hpcdl.doctor", "--json", "--stage-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    facts = json.loads(proc.stdout)["nodes"][0]["facts"]
    gpus = facts["gpus"]
    assert gpus["visible"] == cp.cuda.runtime.getDeviceCount() >= 1, gpus
    assert gpus["bound"] == 0 and gpus["name"], gpus
    assert gpus["cupy"] == cp.__version__ and gpus["cuda_runtime"] and gpus["cuda_driver"], gpus
    # The right answer for the MPI in use: Open MPI's own, from the ompi_info of its install.
    assert facts["cuda_aware"]["aware"] is ompi_built_with_cuda(), facts["cuda_aware"]
    assert "MPIX_Query_cuda_support" in facts["cuda_aware"]["reason"], facts["cuda_aware"]


def ompi_built_with_cuda() -> bool:
    """Whether the Open MPI beside this Python's mpirun was built with CUDA support, as its own
    ompi_info says (opal_built_with_cuda_support, mpi_built_with_cuda_support before 5.0)."""
    ompi_info = BIN / "ompi_info"
    out = subprocess.run(
        [str(ompi_info if ompi_info.exists() else "ompi_info"), "--parsable", "--all"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    values = {
        line.rsplit(":", 1)[1]
        for line in out.splitlines()
        if "_built_with_cuda_support:value:" in line
    }
    assert len(values) == 1, f"ompi_info answers {values or 'nothing'} on CUDA support"
    return values.pop() == "true"


def test_a_job_rendered_with_device_gpu_trains_on_the_gpu(digits_dir, tmp_path):
    """The rendered sbatch script, run by bash with the variables Slurm would set (its launcher
    is mpirun, so no Slurm is needed), trains on the GPU and says so in its metrics."""
    config = tmp_path / "job.toml"
    config.write_text(
        f'data = "{digits_dir / "train"}"\nval_data = "{digits_dir / "val"}"\n'
        'model = "cnn"\nepochs = 1\nbatch_size = 32\nworkers = 1\n'
    )
    render = subprocess.run(
        [sys.executable, "-m", "hpcdl.jobs", "render", "train", "--nodes", "1"]
        + ["--tasks-per-node", "1", "--device", "gpu", "--time", "00:05:00"]
        + ["--config", str(config), "--output", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert render.returncode == 0, render.stderr
    assert "#SBATCH --gpus-per-node=1" in render.stdout
    script = tmp_path / "job.sbatch"
    script.write_text(render.stdout)
    env = {
        **mpi_env(),
        "SLURM_JOB_ID": "42",
        "SLURM_JOB_NAME": "gpujob",
        "SLURM_JOB_NODELIST": os.uname().nodename,
        "SLURM_NTASKS": "1",
        "HPCDL_STAGE_DIR": str(tmp_path / "stage"),
    }
    proc = subprocess.run(
        ["bash", str(script)], capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    metrics = next(tmp_path.glob("*42.metrics.jsonl"))
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    start = next(r for r in records if r["event"] == "start")
    assert json.loads(start["config"])["device"] == "gpu"
    summary = next(r for r in records if r["event"] == "summary")
    assert summary["steps"] > 0 and summary["val_accuracy"] is not None


@pytest.mark.parametrize(
    ("name", "shape"), [("resnet20", (3, 16, 16)), ("resnet18", (3, 64, 64)), ("cnn", (3, 16, 16))]
)
def test_a_model_computes_the_same_step_on_numpy_and_cupy(name, shape):
    """float64: logits, loss and every parameter's gradient agree to 1e-9 relative between the
    backends (dropout off: its masks come from each backend's own generator). A failure names
    the parameters whose gradients differ most, which locates the layer."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, *shape))
    y = rng.integers(0, 10, 8)
    out = {}
    for xp in (np, cp):
        model = nn.build_model(name, shape, 10, seed=0, xp=xp, dtype=np.float64)
        for leaf in model.body.leaves():
            if isinstance(leaf, nn.layers.Dropout):
                leaf.rate = 0.0
        logits = model.forward(xp.asarray(x), train=True)
        loss, d = nn.softmax_cross_entropy(logits, xp.asarray(y))
        model.backward(d)
        out[xp.__name__] = (to_host(logits), float(loss), to_host(model.grads), model.layout())
    (l_np, loss_np, g_np, layout), (l_cp, loss_cp, g_cp, _) = out["numpy"], out["cupy"]
    worst = sorted(
        (
            (_rel(g_cp[o : o + int(np.prod(s))], g_np[o : o + int(np.prod(s))]), n)
            for n, s, o in layout
            if np.abs(g_np[o : o + int(np.prod(s))]).max() > 0
        ),
        reverse=True,
    )[:3]
    assert _rel(l_cp, l_np) < 1e-9, (loss_np, loss_cp, worst)
    assert worst[0][0] < 1e-9, worst


def test_the_trainer_takes_the_same_first_step_on_cpu_and_gpu(tmp_path):
    """resnet18 with rrc crops on a JPEG folder, two steps each: the same seed gives the same
    first-step loss on both devices (float32: 1e-4 relative), and after one update the second
    step's loss still agrees to 1e-3 (float32 sums in another order)."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for i in range(32):
        d = tmp_path / "jpegs" / f"c{i % 4}"
        d.mkdir(parents=True, exist_ok=True)
        img = rng.integers(0, 255, (80, 80, 3), dtype=np.uint8)
        Image.fromarray(img).save(d / f"{i:03d}.jpg", quality=90)
    losses = {}
    for device in ("cpu", "gpu"):
        metrics = tmp_path / f"{device}.jsonl"
        proc = subprocess.run(
            [sys.executable, "-m", "hpcdl.train", "--device", device]
            + ["--data", str(tmp_path / "jpegs"), "--model", "resnet18", "--augment", "rrc64+flip"]
            + ["--batch-size", "16", "--max-steps", "2", "--workers", "1", "--seed", "0"]
            + ["--metrics", str(metrics), "--metrics-every", "1", "--quiet"],
            capture_output=True,
            text=True,
            env=mpi_env(),
            timeout=180,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        steps = [json.loads(r) for r in metrics.read_text().splitlines()]
        losses[device] = [r["loss"] for r in steps if r["event"] == "step"]
    assert len(losses["cpu"]) == len(losses["gpu"]) == 2, losses
    np.testing.assert_allclose(losses["gpu"][0], losses["cpu"][0], rtol=1e-4, err_msg=str(losses))
    np.testing.assert_allclose(losses["gpu"][1], losses["cpu"][1], rtol=1e-3, err_msg=str(losses))
