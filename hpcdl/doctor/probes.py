"""Facts one rank can find out about itself: MPI, GPUs, CuPy, BLAS threads, loader, stager, Slurm.

Each probe returns (facts, problems); facts are small JSON values. Probes never raise for a
missing piece: a missing piece is a fact, and a problem when training needs it.
"""

from __future__ import annotations

import os
from typing import Any

from hpcdl import backend
from hpcdl.comm import blas_threads, cuda_aware
from hpcdl.data.worker_cores import WorkerCores, cpu_list
from hpcdl.doctor.findings import ERROR, WARNING, Problem
from hpcdl.nn import kernels
from hpcdl.nn.kernels import cudnn_graphs

THREAD_LEVELS = (
    "MPI_THREAD_SINGLE",
    "MPI_THREAD_FUNNELED",
    "MPI_THREAD_SERIALIZED",
    "MPI_THREAD_MULTIPLE",
)
THREAD_VARS = blas_threads.THREAD_VARS
Found = tuple[dict[str, Any], list[Problem]]


def mpi(comm: Any) -> Found:
    """The MPI library, standard version, the loaded libmpi and the thread level granted."""
    from mpi4py import MPI  # noqa: PLC0415

    library = MPI.Get_library_version().strip().splitlines()[0].split(",")[0]
    level = MPI.Query_thread()
    names = dict(
        zip(
            (MPI.THREAD_SINGLE, MPI.THREAD_FUNNELED, MPI.THREAD_SERIALIZED, MPI.THREAD_MULTIPLE),
            THREAD_LEVELS,
        )
    )
    facts = {
        "library": library,
        "standard": "{}.{}".format(*MPI.Get_version()),
        "libmpi": cuda_aware.loaded_libmpi(),
        "mpi4py": __import__("mpi4py").__version__,
        "thread_level": names.get(level, str(level)),
    }
    problems = []
    if level < MPI.THREAD_MULTIPLE:
        problems.append(
            Problem(
                ERROR,
                f"MPI granted {facts['thread_level']}, but hpcdl.train reduces gradients on a "
                "helper thread and needs MPI_THREAD_MULTIPLE; fix: use an MPI built with thread "
                "support (Open MPI >= 3 has it by default), mpi4py.rc.thread_level 'multiple'",
            )
        )
    return facts, problems


def cuda_awareness(comm: Any) -> Found:
    """What hpcdl.train --device gpu would decide, and why (hpcdl.comm.cuda_aware.detect)."""
    try:
        answer = cuda_aware.detect(comm, "gpu")
    except ValueError as exc:  # a bad HPCDL_CUDA_AWARE
        return {"aware": None, "reason": str(exc)}, [
            Problem(ERROR, f"{exc}; fix: unset it or set 0 or 1")
        ]
    return {"aware": answer.aware, "reason": answer.reason}, []


def gpus(local_rank: int, local_size: int) -> Found:
    """GPUs this rank sees, the one it would bind (local rank modulo visible GPUs), CuPy/CUDA."""
    facts: dict[str, Any] = {
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "visible": 0,
        "bound": None,
        "name": None,
        "cupy": None,
        "cuda_runtime": None,
        "cuda_driver": None,
        "cudnn": None,  # cuDNN's version through its frontend (--gpu-kernels), if installed
        "gpu_kernels": kernels.enabled(),  # HPCDL_GPU_KERNELS: fast kernels and step graphs
        "tf32": kernels.tf32(),  # HPCDL_TF32: float32 convolutions and GEMMs on TF32 cores
        "deterministic": kernels.deterministic(),  # HPCDL_DETERMINISTIC: cuDNN's engines
        "autotune": kernels.autotune(),  # HPCDL_CUDNN_AUTOTUNE: engines timed per convolution
        "half_wgrad": kernels.half_wgrad(),  # HPCDL_HALF_WGRAD: weight gradients in the format
    }
    try:
        import cupy  # noqa: PLC0415

        facts["cupy"] = cupy.__version__
    except ImportError:
        return facts, []
    except Exception as exc:  # a broken install: CuPy's own message
        return facts, [
            Problem(WARNING, f"CuPy does not import ({exc}); fix: reinstall 'hpcdl[gpu]'")
        ]
    try:
        facts["cuda_runtime"] = _cuda_version(cupy.cuda.runtime.runtimeGetVersion())
        facts["cuda_driver"] = _cuda_version(cupy.cuda.runtime.driverGetVersion())
    except Exception:  # no driver: CuPy imports but cannot talk to a GPU
        pass
    facts["cudnn"] = cudnn_version()
    count = backend.visible_gpu_count()
    facts["visible"] = count
    if count:
        facts["bound"] = local_rank % count
        props = cupy.cuda.runtime.getDeviceProperties(facts["bound"])
        facts["name"] = (
            props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
        )
    problems = []
    if count and local_size > count:
        problems.append(
            Problem(
                WARNING,
                f"{local_size} ranks on this node share {count} GPU(s): --device gpu puts several "
                f"ranks on one GPU; fix: start one rank per GPU (e.g. --ntasks-per-node={count})",
            )
        )
    return facts, problems


def cudnn_version() -> str | None:
    """cuDNN's backend version as major.minor.patch (91900 -> 9.19.0), or None without the
    frontend or its library."""
    number = cudnn_graphs.version()
    if number is None or not number.isdigit():
        return number
    value = int(number)
    return f"{value // 10000}.{value // 100 % 100}.{value % 100}"


def _cuda_version(number: int) -> str:
    return f"{number // 1000}.{number % 1000 // 10}"


def blas(node_comm: Any) -> Found:
    """NumPy's BLAS and the threads hpcdl.train will run per rank (hpcdl.comm.blas_threads),
    against the cores this rank may use. Collective on node_comm."""
    mine = blas_threads.affinity()
    masks = node_comm.allgather(mine)
    choice = blas_threads.choose(mine, masks, os.environ)
    sharing = blas_threads.sharers(mine, masks)
    facts: dict[str, Any] = {
        "library": blas_threads.current().library,
        "threads": choice.threads,
        "reason": choice.reason,
        "cores": len(mine),
        "node_cores": os.cpu_count() or len(mine),
        **{var: os.environ.get(var) for var in THREAD_VARS},
    }
    problems = []
    if choice.threads * sharing > len(mine):  # only an explicit thread variable gets here
        fair = max(1, len(mine) // sharing)
        problems.append(
            Problem(
                WARNING,
                f"{sharing} rank(s) x {choice.threads} BLAS threads on {len(mine)} cores "
                f"({choice.reason}): the threads compete; fix: export OMP_NUM_THREADS={fair} "
                "or unset it (hpcdl.train then divides the cores itself)",
            )
        )
    return facts, problems


def loader(
    workers: int | None,
    prefetch: str,
    batch: int,
    shape: tuple,
    local_size: int,
    cores: WorkerCores | None = None,
) -> Found:
    """Loader workers and batch slots per rank, as hpcdl.train would choose them for a batch of
    `batch` samples of shape (C, H, W) (hpcdl.data.loader NOTE [default slots]), and the cores
    the workers run on (cores: hpcdl.data.worker_cores; None: the default workers of an unbound
    rank); a warning where the slots leave workers idle."""
    from hpcdl.data.loader import default_slots, default_workers, slot_warning  # noqa: PLC0415
    from hpcdl.data.slots import SlotLayout, free_bytes, shm_dir, shm_shortfall  # noqa: PLC0415

    if workers is None:
        workers = cores.default_workers if cores else default_workers(ranks_per_node=local_size)
    one = SlotLayout(1, batch, shape).slot_bytes
    free = free_bytes(shm_dir())
    auto = prefetch == "auto"
    slots = default_slots(workers, one, free, local_size) if auto else int(prefetch)
    facts = {
        "workers": workers,
        "slots": slots,
        "slots_default": auto,
        "slot_bytes": one,
        "batch": batch,
        "shape": list(shape),
        "shm_dir": shm_dir(),
        "shm_free_bytes": free,
    }
    if cores is not None:  # the rank's mask, and its workers' (wider where cores were free)
        facts["rank_cores"], facts["worker_cores"] = cpu_list(cores.bound), cpu_list(cores.cores)
    from hpcdl.data.gpu_decode import gpu_decode_available  # noqa: PLC0415

    facts["gpu_decode"], facts["gpu_decode_reason"] = gpu_decode_available()
    problems = []
    short = shm_shortfall(SlotLayout(slots, batch, shape), local_size)
    if short:  # what hpcdl.train stops with (exit status 2), for this node's ranks together
        problems.append(Problem(ERROR, short.replace("; enlarge it", "; fix: enlarge it")))
    warning = slot_warning(workers, slots) if workers else None
    if warning:
        problems.append(Problem(WARNING, warning.replace("; give", "; fix: give")))
    return facts, problems


def stager() -> Found:
    """Where hpcdl-stage is (as hpcdl.staging finds it) and its --version line."""
    import subprocess  # noqa: PLC0415

    from hpcdl.staging.binary import StagerNotFound, find_stager_binary  # noqa: PLC0415

    try:
        path = find_stager_binary()
    except StagerNotFound as exc:
        if os.environ.get("HPCDL_STAGE_BIN"):
            fix = "set it to the hpcdl-stage that pip install built, or unset it"
        else:
            fix = "run pip install . in the hpcdl checkout (it builds hpcdl-stage)"
        why = str(exc).split(":")[0] if not os.environ.get("HPCDL_STAGE_BIN") else str(exc)
        return {"path": None, "version": None}, [
            Problem(ERROR, f"{why}; --stage-dir needs it; fix: {fix}")
        ]
    facts: dict[str, Any] = {"path": str(path), "version": None}
    try:
        out = subprocess.run([str(path), "--version"], capture_output=True, text=True, timeout=30)
    except OSError as exc:
        return facts, [
            Problem(
                ERROR, f"{path} does not run ({exc.strerror}); fix: rebuild it with pip install ."
            )
        ]
    if out.returncode != 0 or not out.stdout.startswith("hpcdl-stage "):
        said = ((out.stdout or out.stderr).strip().splitlines() or [""])[0]
        return facts, [
            Problem(
                ERROR,
                f"{path} is not a working hpcdl-stage (--version said {said!r}, exit status "
                f"{out.returncode}); fix: rebuild it with pip install . (or set HPCDL_STAGE_BIN)",
            )
        ]
    facts["version"] = out.stdout.strip()
    return facts, []


def torch_engine() -> Found:
    """The packages hpcdl.train's torch engine needs (`--model FILE.py:FN` returning a
    torch.nn.Module: torch; `--model torchvision:NAME`: torchvision too), by their installed
    metadata: torch is not imported. Neither is a problem: hpcdl's own models need neither."""
    from importlib import metadata  # noqa: PLC0415

    facts: dict[str, Any] = {}
    for package in ("torch", "torchvision"):
        try:
            facts[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            facts[package] = None
    return facts, []


def slurm(world_size: int, num_nodes: int, cores: int) -> Found:
    """Slurm's view of the job against the MPI world this process is in."""
    env = os.environ
    if not env.get("SLURM_JOB_ID"):
        return {"job_id": None}, []
    facts = {
        "job_id": env.get("SLURM_JOB_ID"),
        "ntasks": env.get("SLURM_NTASKS"),
        "nnodes": env.get("SLURM_NNODES") or env.get("SLURM_JOB_NUM_NODES"),
        "cpus_per_task": env.get("SLURM_CPUS_PER_TASK"),
        "step_id": env.get("SLURM_STEP_ID"),
    }
    problems = []
    ntasks = facts["ntasks"]
    if ntasks and ntasks.isdigit() and int(ntasks) != world_size:
        problems.append(
            Problem(
                WARNING,
                f"SLURM_NTASKS={ntasks} but the MPI world has {world_size} rank(s): the job's "
                "tasks are not one MPI job; fix: start it with srun (--mpi=pmix) or mpirun inside "
                "the allocation, with as many ranks as tasks",
            )
        )
    nnodes = facts["nnodes"]
    if nnodes and nnodes.isdigit() and int(nnodes) != num_nodes:
        problems.append(
            Problem(
                WARNING,
                f"SLURM_NNODES={nnodes} but the MPI ranks run on {num_nodes} node(s): some nodes "
                "idle; fix: spread the ranks (--ntasks-per-node, mpirun --map-by ppr:N:node)",
            )
        )
    cpt = facts["cpus_per_task"]
    if cpt and cpt.isdigit() and cores < int(cpt):
        problems.append(
            Problem(
                WARNING,
                f"SLURM_CPUS_PER_TASK={cpt} but this rank may use {cores} core(s): the launcher "
                "binds it tighter than Slurm gave; fix: mpirun --bind-to none or --map-by "
                f"slot:PE={cpt} (srun honours --cpus-per-task)",
            )
        )
    return facts, problems
