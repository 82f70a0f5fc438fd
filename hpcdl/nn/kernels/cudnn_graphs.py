"""cuDNN frontend graphs on CuPy memory: the runtime, the layouts and the plan cache that the
convolution and BatchNorm kernels (hpcdl.nn.kernels.conv, .batchnorm) share.

NOTE [cuDNN graphs]
- The module is NVIDIA's `nvidia-cudnn-frontend` (import name `cudnn`, the gpu extras). CuPy 14
  dropped its own cuDNN module; the frontend's Python graphs run on CuPy memory because the
  variant pack and the workspace are raw device pointers (`array.data.ptr`).
- Variant pack: a device tensor's value is its device address (device_pointer); a host array
  there is refused. A pass-by-value scalar (BatchNorm's epsilon and momentum) is a host
  float32 whose host address goes in (host_address), as the frontend's own tests pass host
  tensors; a NumPy array itself would reach DLPack with a stream and fail. The handle is set
  to CuPy's current stream before each execute, so cuDNN's kernels join the step's stream and
  a CUDA graph capture of it.
- Layout: hpcdl's activations are NHWC and contiguous. cuDNN names dimensions in NCHW order
  and takes the layout from the strides, so an (N, H, W, C) array is dim [N, C, H, W] with
  strides [H*W*C, 1, W*C, C]. Filters are stored (kh, kw, C_in, C_out) in the flat parameter
  buffer (checkpoints, .pth, ONNX and the reducer keep that one layout); cuDNN wants KRSC,
  (C_out, kh, kw, C_in), so a kernel copies the weights into a KRSC workspace per forward
  and transposes the weight gradient back into the flat gradient buffer.
- Plans: building one (validate, operation graph, heuristics A then FALLBACK, support check,
  an engine) costs milliseconds, so each is built once per PlanKey (operation, shapes, dtypes,
  padding, stride) and cached per process. The engine is the first of the heuristics' ranked
  list that builds (build_plan_at_index over the list, the frontend's own walk, which
  build_plans() does too, but naming the engine: Plan.name); with HPCDL_CUDNN_AUTOTUNE=K a
  convolution's first K are built and timed at its first run (NOTE [engine autotuning] in
  hpcdl/nn/kernels/__init__.py). A key cuDNN refuses (cudnnGraphNotSupportedError or
  any error while building) is remembered as refused. In bf16/fp16 that op alone then runs the
  same op's float32 plan (its half inputs copied to float32, exact; the H100 had no bf16 plan
  for resnet50's 7x7 stem weight gradient over 3 channels); with none in float32 either the
  kernel stops applying and the layer's reference runs. Said once, in one line.
- Workspace: one byte buffer from CuPy's memory pool, grown to the largest plan's need
  (hpcdl.nn.workspace), so no step allocates.
- Dtypes (hpcdl.nn.dtypes): I/O in the layer's format (float32, or bf16/fp16 arrays of the
  emulated values: exact), sums (compute and intermediate) in float32. A float32 graph runs
  IEEE float32 engines only, unless --tf32 lets it use TF32 tensor cores (NOTE [TF32] in
  hpcdl/nn/kernels/__init__.py). A float64 model's graphs are DOUBLE throughout (I/O, sums,
  the weight gradient), never float32: where cuDNN has no DOUBLE plan the layer's own float64
  kernel runs (said once), and an op cuDNN has no float64 engine for at all (BatchNorm) never
  asks (io_dtype, the kernels' applies).
Everything here but the calls into `cudnn` runs on CPU: tests/test_nn_cudnn.py drives it with a
stand-in module that executes the graphs in NumPy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from hpcdl.backend import is_device_array
from hpcdl.nn import kernels
from hpcdl.nn.dtypes import half_dtype
from hpcdl.nn.kernels import say_once
from hpcdl.nn.workspace import Workspaces

_FLOAT64 = np.dtype(np.float64)
# the byte alignment the frontend declares for every tensor: a device pointer that is not (a view
# into a flat vector at an odd offset) stops a real GPU with cudaErrorMisalignedAddress (the
# H200 run of 2026-11-29: BatchNorm's gamma views, 8 bytes past a 16-byte boundary)
ALIGNMENT = 16
_DATA_TYPES = {"float32": "FLOAT", "float64": "DOUBLE", "float16": "HALF", "bfloat16": "BFLOAT16"}
# a tensor's dtype: a bitmask, cuDNN's BOOLEAN (eight elements to a byte; a uint8 array holds it)
BITMASK = "bitmask"
# the most workspace an engine may ask for and still be timed (NOTE [engine autotuning])
TUNE_WORKSPACE_BYTES = 512 << 20


def nhwc(shape: tuple[int, ...]) -> tuple[list[int], list[int]]:
    """cuDNN (dim, stride) of a contiguous (N, H, W, C) array, or of (C,) as (1, C, 1, 1)."""
    if len(shape) == 1:
        (c,) = shape
        return [1, c, 1, 1], [c, 1, c, c]
    n, h, w, c = shape
    return [n, c, h, w], [h * w * c, 1, w * c, c]


def krsc(weight_shape: tuple[int, int, int, int]) -> tuple[list[int], list[int]]:
    """cuDNN (dim, stride) of the KRSC workspace, (C_out, kh, kw, C_in) contiguous, for a
    weight stored (kh, kw, C_in, C_out)."""
    kh, kw, c_in, c_out = weight_shape
    return [c_out, c_in, kh, kw], [kh * kw * c_in, 1, kw * c_in, c_in]


@dataclass(frozen=True)
class PlanKey:
    """What makes a plan: the operation and everything its graph is built from."""

    op: str  # conv_fprop | conv_dgrad | conv_wgrad | bn_train | bn_backward
    shapes: tuple[tuple[int, ...], ...]  # (x, w or scale, y) in hpcdl's layouts
    io: str  # "float32", "float64", "bfloat16" or "float16"
    padding: tuple[int, int] = (0, 0)
    stride: tuple[int, int] = (1, 1)
    tf32: bool = False  # a float32 plan that may run TF32 engines (--tf32; PlanCache sets it)
    deterministic: bool = False  # without nondeterministic engines (PlanCache sets it)
    autotune: int = 0  # engines timed for a convolution (HPCDL_CUDNN_AUTOTUNE; PlanCache sets it)


@dataclass
class Plan:
    """A built graph and its tensors by name; run() executes it on arrays."""

    graph: Any
    tensors: dict[str, Any]
    workspace_bytes: int
    by_value: frozenset[str] = frozenset()  # host scalars: their pack value is a host address
    io: np.dtype = np.dtype(np.float32)  # the I/O dtype it was built for (PlanCache sets it)
    out: np.dtype | None = None  # a convolution's output dtype (a weight gradient's: float32)
    index: int = 0  # the engine it runs: its place in the heuristics' ranked list (-1: unknown)
    name: str = ""  # that engine's name, as cuDNN gives it
    untimed: tuple[int, ...] = ()  # engines built and not yet timed (autotune), index first
    timed_ms: dict[int, float] = field(default_factory=dict)  # autotune: engine -> best ms


def device_pointer(array: Any) -> int:
    """The device address cuDNN's variant pack takes for a device (CuPy) array."""
    if not is_device_array(array):
        raise TypeError(f"cuDNN reads device memory; got a {type(array).__name__} (a host array)")
    return int(array.data.ptr)


def host_address(array: Any) -> int:
    """The host address of a pass-by-value scalar: one C-contiguous NumPy element, which must
    stay alive until the execute that reads it returns (cuDNN reads it at launch)."""
    if not isinstance(array, np.ndarray) or array.size != 1 or not array.flags.c_contiguous:
        raise TypeError(f"a pass-by-value scalar is one NumPy element; got {type(array).__name__}")
    return int(array.ctypes.data)


def current_stream() -> int:
    """CuPy's current stream: the one cuDNN's handle is set to before each execute, so that its
    kernels join the step's stream (and a CUDA graph capture on it)."""
    import cupy  # noqa: PLC0415 - only on the device path

    return int(cupy.cuda.get_current_stream().ptr)


def stream_capturing() -> bool:
    """Whether CuPy's current stream is capturing a CUDA graph (nothing may be timed then)."""
    import cupy  # noqa: PLC0415 - only on the device path

    return bool(cupy.cuda.get_current_stream().is_capturing())


def cuda_ms(run: Callable[[], None]) -> float:
    """Milliseconds of device time run() takes on CuPy's current stream (CUDA events)."""
    import cupy  # noqa: PLC0415 - only on the device path

    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    run()
    stop.record()
    stop.synchronize()
    return float(cupy.cuda.get_elapsed_time(start, stop))


@dataclass
class Runtime:
    """The cuDNN module, its handle and how arrays become pointers. The default is CuPy's;
    tests give a stand-in module and NumPy arrays."""

    cudnn: Any
    pointer: Callable[[Any], int] = device_pointer  # device tensors; scalars: host_address
    is_device: Callable[[Any], bool] = is_device_array
    stream: Callable[[], int] = current_stream
    capturing: Callable[[], bool] = stream_capturing
    timer: Callable[[Callable[[], None]], float] = cuda_ms  # ms a run takes (autotune)
    handle: Any = None
    work: Workspaces = field(default_factory=Workspaces)

    def __post_init__(self) -> None:
        if self.handle is None:
            self.handle = self.cudnn.create_handle()

    def data_type(self, dtype: Any) -> Any:
        if isinstance(dtype, str) and dtype == BITMASK:
            return self.cudnn.data_type.BOOLEAN
        return getattr(self.cudnn.data_type, _DATA_TYPES[np.dtype(dtype).name])

    def graph(self, io_dtype: Any) -> Any:
        """A graph with I/O in io_dtype and sums in sums_dtype(io_dtype)."""
        sums = self.data_type(sums_dtype(io_dtype))
        return self.cudnn.pygraph(
            io_data_type=self.data_type(io_dtype),
            intermediate_data_type=sums,
            compute_data_type=sums,
            handle=self.handle,
        )

    def tensor(self, graph: Any, name: str, layout: tuple[list[int], list[int]], dtype: Any):
        dim, stride = layout
        return graph.tensor(name=name, dim=dim, stride=stride, data_type=self.data_type(dtype))

    def scalar(self, graph: Any, name: str) -> Any:
        """A float32 scalar passed by value: its variant-pack value is a host address."""
        return graph.tensor(
            name=name,
            dim=[1, 1, 1, 1],
            stride=[1, 1, 1, 1],
            data_type=self.cudnn.data_type.FLOAT,
            is_pass_by_value=True,
        )

    def output(self, tensor: Any, layout: tuple[list[int], list[int]], dtype: Any) -> None:
        """Mark a graph's result as an output of this layout and dtype."""
        dim, stride = layout
        tensor.set_output(True).set_dim(dim).set_stride(stride).set_data_type(self.data_type(dtype))

    def finish(
        self,
        graph: Any,
        tensors: dict[str, Any],
        io_dtype: Any,
        by_value: tuple[str, ...] = (),
        tune: bool = False,
    ) -> Plan:
        """Validate a graph described with io_dtype and build its engine (the frontend's
        sequence); a float32 graph without --tf32 leaves out the engines cuDNN notes as
        running on tensor cores (TF32, NOTE [TF32]), and with HPCDL_DETERMINISTIC any graph
        those it notes as nondeterministic (NOTE [deterministic engines]); by_value names the
        tensors of scalar(); tune: a graph that may run several times on the same arrays
        (a convolution), whose first autotune() engines are built to be timed."""
        graph.validate()
        graph.build_operation_graph()
        graph.create_execution_plans([self.cudnn.heur_mode.A, self.cudnn.heur_mode.FALLBACK])
        note, notes = self.cudnn.numerical_note, []
        if np.dtype(io_dtype) == np.float32 and not kernels.tf32():
            notes += [note.TENSOR_CORE, note.DOWN_CONVERT_INPUTS]
        if kernels.deterministic():
            notes.append(note.NONDETERMINISTIC)
        if notes:
            graph.deselect_numeric_notes(notes)
        graph.check_support()
        built = self._build_engines(graph, max(1, kernels.autotune()) if tune else 1)
        plan = Plan(graph, tensors, int(graph.get_workspace_size()), frozenset(by_value))
        plan.index, plan.name = built[0], engine_name(graph, built[0])
        plan.untimed = tuple(built) if len(built) > 1 else ()
        return plan

    @staticmethod
    def _build_engines(graph: Any, want: int) -> list[int]:
        """Build the first `want` engines of the graph's ranked list that build, and select the
        first (its index leads the list). Where none builds, build_plans() raises cuDNN's
        reason (the frontend's own walk over the same list)."""
        built: list[int] = []
        for index in range(int(graph.get_execution_plan_count())):
            try:
                graph.build_plan_at_index(index)
            except Exception:  # noqa: BLE001 - left out by a note, or declined: the next
                continue
            built.append(index)
            if len(built) == want:
                break
        if not built:  # the frontend's own walk: cuDNN's reason, or its choice (index unknown)
            graph.build_plans()
            return [-1]
        if len(built) > 1:
            graph.build_plan_at_index(built[0])  # built: this only selects it
        return built

    def run(self, plan: Plan, arrays: dict[str, Any], xp: Any) -> None:
        """Execute plan with arrays by tensor name on the current stream: device arrays as
        device pointers, pass-by-value scalars as host addresses (NOTE [cuDNN graphs]). An
        array not ALIGNMENT-byte aligned (a view into a flat vector that no shift of it could
        align: hpcdl.nn.model.aligned_zeros; BatchNorm's beta behind 5 channels of gamma) goes
        through an aligned copy of its own, in and back out; one array under two names
        (running statistics updated in place) is one copy."""
        pack, staged = {}, {}
        for name, a in arrays.items():
            if name in plan.by_value:
                pack[plan.tensors[name]] = host_address(a)
                continue
            address = self.pointer(a)
            if address % ALIGNMENT:
                if address not in staged:
                    copy = self.work.get(f"cudnn_aligned:{address}", a.shape, a.dtype, xp)
                    copy[...] = a
                    staged[address] = (a, copy)
                address = self.pointer(staged[address][1])
            pack[plan.tensors[name]] = address
        self.cudnn.set_stream(handle=self.handle, stream=self.stream())
        if plan.untimed and not self.capturing():
            self._tune_or_keep(plan, pack, xp)
        size = max(plan.workspace_bytes, 1)
        workspace = self.work.at_least("cudnn_workspace", (size,), np.uint8, xp)
        plan.graph.execute(pack, self.pointer(workspace), handle=self.handle)
        for a, copy in staged.values():  # outputs back where they belong (inputs: unchanged)
            a[...] = copy

    def _tune_or_keep(self, plan: Plan, pack: dict[Any, int], xp: Any) -> None:
        """tune(), or where it fails, the heuristics' engine selected again, said once: the
        step goes on either way."""
        try:
            self.tune(plan, pack, xp)
        except Exception as exc:  # noqa: BLE001 - a failed timing never stops the step
            plan.untimed, plan.timed_ms = (), {}
            say_once(
                "cudnn-autotune-failed",
                f"timing cuDNN's engines failed ({type(exc).__name__}: {exc}); the heuristics' "
                "engines run (HPCDL_CUDNN_AUTOTUNE)",
            )
            plan.graph.build_plan_at_index(plan.index)

    def tune(self, plan: Plan, pack: dict[Any, int], xp: Any) -> None:
        """Time the plan's built engines on pack's arrays and select the fastest (NOTE [engine
        autotuning]): each run once, then the best of 3 by the timer; an engine that fails to
        run, or needs over TUNE_WORKSPACE_BYTES of workspace, is not chosen. The workspace for
        the timing is a temporary of the largest engine timed."""
        graph, untimed, plan.untimed = plan.graph, plan.untimed, ()
        need = {i: int(graph.get_workspace_size_plan_at_index(i)) for i in untimed}
        timed = [i for i in untimed if need[i] <= TUNE_WORKSPACE_BYTES]
        space = xp.empty(max([need[i] for i in timed] + [1]), dtype=np.uint8)
        address = self.pointer(space)
        for index in timed:

            def once(index: int = index) -> None:
                graph.execute_plan_at_index(pack, address, index, handle=self.handle)

            try:
                once()
                plan.timed_ms[index] = min(self.timer(once) for _ in range(3))
            except Exception:  # noqa: BLE001 - an engine that does not run is not chosen
                continue
        if not plan.timed_ms:
            return
        best = min(plan.timed_ms, key=plan.timed_ms.__getitem__)
        graph.build_plan_at_index(best)  # built: this selects it
        plan.index, plan.name, plan.workspace_bytes = best, engine_name(graph, best), need[best]


def plan_report(
    families: tuple[str, ...] = ("conv", "batchnorm"), each: bool = False
) -> dict[str, Any] | None:
    """What the process's cuDNN plans run, for a --json result: plans per engine name, and
    with autotuning (NOTE [engine autotuning]) how many plans were timed, how many chose
    another engine than the heuristics' first, and the ms per run of every plan together,
    heuristics' first against the chosen (each plan once; a plan runs once per step, so it is
    a per-step saving); each: also every plan's key and engine. None where no plan was built."""
    plans = {
        key: plan
        for family in families
        for kernel in kernels.candidates(family)
        for key, plan in getattr(getattr(kernel, "cache", None), "_plans", {}).items()
    }
    if not plans:
        return None
    engines: dict[str, int] = {}
    for plan in plans.values():
        engines[plan.name or "?"] = engines.get(plan.name or "?", 0) + 1
    timed = [p for p in plans.values() if p.timed_ms]
    first = [p.timed_ms[min(p.timed_ms)] for p in timed]  # the heuristics' first that was timed
    report = {
        "plans": len(plans),
        "engines": dict(sorted(engines.items(), key=lambda kv: -kv[1])),
        "timed": len(timed),
        "changed": sum(p.index != min(p.timed_ms) for p in timed),
        "first_ms": round(sum(first), 3),
        "chosen_ms": round(sum(p.timed_ms[p.index] for p in timed), 3),
    }
    if each:
        report["each"] = [f"{k.op} {k.shapes} {k.io}: {p.name}" for k, p in plans.items()]
    return report


def engine_name(graph: Any, index: int) -> str:
    """The name cuDNN gives the engine at index of graph's ranked list ("" where it gives none)."""
    try:
        return str(graph.get_plan_name_at_index(index))
    except Exception:  # noqa: BLE001 - a name is for reports: none is no failure
        return ""


class PlanCache:
    """Plans by PlanKey, each built once. A key cuDNN refused stays refused; in a half format the
    same op's float32 plan stands in for it (that op alone, NOTE [cuDNN graphs]); either way the
    refusal is said once, in one line."""

    def __init__(
        self, build: Callable[[PlanKey], Plan], refused: str = "that layer runs hpcdl's own kernels"
    ) -> None:
        self._build = build
        self._refused_then = refused  # what runs instead, as said
        self._plans: dict[PlanKey, Plan] = {}
        self.refused: dict[PlanKey, str] = {}  # key -> cuDNN's reason, its first line
        self.builds = 0  # plans built so far (each key once)

    def get(self, key: PlanKey) -> Plan | None:
        """key's plan; else, for a half format, the float32 one; else None (the reference).
        A float64 key never narrows to float32: without its DOUBLE plan the reference runs."""
        key = _as_built(key)
        plan = self._built(key)
        if plan is not None:
            return plan
        half = key.io in ("bfloat16", "float16")
        wide = self._built(_as_built(replace(key, io="float32"))) if half else None
        then = "that op runs in float32" if wide else self._refused_then
        why = self.refused[key]
        say_once(
            f"cudnn-refused:{key}",
            f"cuDNN has no plan for {key.op} {key.shapes} in {key.io} ({why}); {then}",
        )
        return wide

    def _built(self, key: PlanKey) -> Plan | None:
        if key in self.refused:
            return None
        plan = self._plans.get(key)
        if plan is None:
            self.builds += 1
            try:
                plan = self._plans[key] = self._build(key)
            except Exception as exc:  # noqa: BLE001 - any refusal means: the reference runs
                first = (str(exc).strip().splitlines() or [""])[0][:160]
                self.refused[key] = f"{type(exc).__name__}: {first}"
                return None
            plan.io = dtype_named(key.io)
        return plan


def _as_built(key: PlanKey) -> PlanKey:
    """key as it is built now: a float32 plan with --tf32 is another plan (NOTE [TF32]), and
    so is a deterministic one (NOTE [deterministic engines]) and one autotuned otherwise (NOTE
    [engine autotuning]). Called per op and step: with none changed, the key is returned as it
    is, no copy."""
    tf32 = key.io == "float32" and kernels.tf32()
    deterministic, autotune = kernels.deterministic(), kernels.autotune()
    if key.tf32 == tf32 and key.deterministic == deterministic and key.autotune == autotune:
        return key
    return replace(key, tf32=tf32, deterministic=deterministic, autotune=autotune)


def in_dtype(work: Workspaces, name: str, array: Any, dtype: Any, xp: Any) -> Any:
    """array as dtype: itself, or its copy in workspace name (an op whose plan fell back to
    float32 reads the half arrays of the ops around it; exact, half values are float32's)."""
    if array.dtype == dtype:
        return array
    copy = work.get(f"{name}:{np.dtype(dtype).name}", array.shape, dtype, xp)
    copy[...] = array
    return copy


def operand(work: Workspaces, name: str, x: Any, dtype: Any, xp: Any) -> Any:
    """x as a graph reads it: itself where it is C-contiguous in dtype, else its copy in the
    workspace name (an emulated activation in the format, a half array whose plan fell back
    to float32: exact either way)."""
    if x.dtype == dtype and x.flags.c_contiguous:
        return x
    copy = work.get(name, x.shape, dtype, xp)
    copy[...] = x
    return copy


def kept(work: Workspaces, name: str, x: Any, dtype: Any, xp: Any) -> Any:
    """operand(x), held for the backward (Workspaces.hold): a layer's input, which nothing
    changes before the layer's backward has read it (a convolution's or BatchNorm's), is not
    copied; a pass over each such input per step."""
    return work.hold(name, operand(work, name, x, dtype, xp))


def io_dtype(precision: str, params: Any = np.float32) -> np.dtype:
    """The I/O dtype of a layer at --precision whose parameters are of dtype params: float64 for
    a float64 model, else its format's arrays (hpcdl.nn.dtypes)."""
    return _FLOAT64 if np.dtype(params) == _FLOAT64 else half_dtype(precision)


def sums_dtype(io: Any) -> np.dtype:
    """The dtype of a graph's sums, statistics and weight gradient for I/O in io: float64 for
    float64, else float32."""
    return _FLOAT64 if np.dtype(io) == _FLOAT64 else np.dtype(np.float32)


def dtype_named(name: str) -> np.dtype:
    """The dtype a PlanKey names ("float32", "float64", "bfloat16", "float16")."""
    if name == "float64":
        return _FLOAT64
    return half_dtype({"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[name])


_RUNTIME: Runtime | None = None
_LOADED = False


def runtime() -> Runtime | None:
    """The process's cuDNN runtime on CuPy, or None without the frontend (said once)."""
    global _RUNTIME, _LOADED
    if not _LOADED:
        _LOADED = True
        try:
            import cudnn  # noqa: PLC0415

            _RUNTIME = Runtime(cudnn)
        except Exception as exc:  # noqa: BLE001 - no module, no library, no GPU: the reference
            say_once(
                "cudnn-missing",
                f"--gpu-kernels: cuDNN's frontend is not usable ({type(exc).__name__}: {exc}); "
                "convolution and BatchNorm run hpcdl's own kernels (pip install 'hpcdl[gpu]')",
            )
    return _RUNTIME


def runtime_for(x: Any) -> Runtime | None:
    """The runtime when x is an array it runs on (a device array), else None; host arrays never
    load the frontend, so CPU runs with --gpu-kernels say nothing about cuDNN."""
    if _LOADED:
        return _RUNTIME if _RUNTIME is not None and _RUNTIME.is_device(x) else None
    return runtime() if is_device_array(x) else None


def version() -> str | None:
    """cuDNN's backend version as the frontend reports it, or None (hpcdl doctor)."""
    try:
        import cudnn  # noqa: PLC0415

        return str(cudnn.backend_version())
    except Exception:  # noqa: BLE001 - not installed or no library: nothing to report
        return None
