"""A strict stand-in for NVIDIA's cuDNN frontend module (`cudnn`) that executes its graphs in NumPy.

Each method takes the real one's parameters: names, positional order, keyword-only names and
defaults of nvidia-cudnn-frontend 1.32 (tests/test_nn_cudnn_stand_in.py holds the wheel's).
It refuses what the real frontend (its `python/` bindings and `test/python/` tests) refuses, so
that a CPU test fails where a GPU run would:
- enum arguments (data types, heuristic modes) that are not the module's own members, and
  dims / strides / padding that are not lists of ints of the right length;
- a variant-pack value that is not a pointer: the real one takes an int address, a tensor with
  data_ptr() or a CuPy array (.data.ptr), and hands anything else to DLPack with a stream,
  which a NumPy array refuses ("NumPy only supports stream=None.");
- a tensor of the graph missing from the variant pack, or a pack keyed by a foreign tensor;
- a pass-by-value tensor (host scalar) that is not [1, 1, 1, 1], or whose pack value is a
  device pointer; BatchNorm's epsilon and momentum not passed by value (as the frontend's own
  BatchNorm test passes them: host tensors);
- an op on anything but the graph's tensors (what has no shape: AttributeError, as the
  frontend's tensor_like), a compute_data_type that is no cudnn.data_type, ReLU clips and
  slope not floats; a convolution without padding, stride or dilation;
- operands of one convolution in different data types, statistics not in FLOAT (no engine:
  cudnnGraphNotSupportedError at check_support), and `refuse(op, dims, data_type)` for a shape
  cuDNN has no engine for;
- a numeric-note filter (deselect_numeric_notes) before create_execution_plans or after
  check_support, or of notes that are not cudnn.numerical_note members;
- the build steps out of order, executing an unbuilt graph, a workspace smaller than asked,
  a handle that create_handle did not make;
- engines, as frontend 1.32's ranked plan list (`Module(engines=...)`, each an Engine with a
  name, numerical notes, workspace, whether it builds and its time): an index out of range
  (IndexError), one a note filter left out (ValueError, as its _reject_if_barred), one that
  does not build (cudnnGraphNotSupportedError), executing an engine not built; a graph whose
  every engine a note filter left out finds no engine at check_support.
Where frontend 1.32 finds a fault only when it lowers the graph to the backend (types, missing
attributes), the stand-in refuses at the call, with the kind of error the lowering raises.
It is stricter than the real one where a fault would pass silently: a pack keyed by another
graph's tensor (the frontend takes its uid for this graph's), an array as an op's operand (the
frontend binds it; hpcdl declares every tensor), and layouts: a device pointer must be one
`pointer()` handed out, and a declared dim / stride must fit inside that array and its dtype
must be the declared one (the backend would read whatever bytes lie there).

Device memory is NumPy: `pointer(array)` registers an array as device memory and returns its
address, which is what hpcdl.nn.kernels.cudnn_graphs.Runtime(pointer=module.pointer) puts in the
variant pack. Every tensor is read through the dim and stride the kernel declared (cuDNN's
NCHW-ordered names over hpcdl's NHWC / KRSC memory), so a wrong layout gives wrong numbers.
"""

from __future__ import annotations

import ctypes
import enum

import numpy as np


class cudnnGraphNotSupportedError(Exception):  # noqa: N801 - the frontend's own name
    pass


class data_type(str, enum.Enum):  # noqa: N801 - the frontend's own name
    FLOAT = "FLOAT"
    DOUBLE = "DOUBLE"
    HALF = "HALF"
    BFLOAT16 = "BFLOAT16"
    INT32 = "INT32"
    INT64 = "INT64"
    BOOLEAN = "BOOLEAN"  # a bitmask: eight elements to a byte (cudnn's BOOLEAN is packed)
    NOT_SET = "NOT_SET"


class heur_mode(str, enum.Enum):  # noqa: N801
    A = "A"
    B = "B"
    FALLBACK = "FALLBACK"


class numerical_note(str, enum.Enum):  # noqa: N801
    TENSOR_CORE = "TENSOR_CORE"
    DOWN_CONVERT_INPUTS = "DOWN_CONVERT_INPUTS"
    REDUCED_PRECISION_REDUCTION = "REDUCED_PRECISION_REDUCTION"
    FFT = "FFT"
    NONDETERMINISTIC = "NONDETERMINISTIC"
    WINOGRAD = "WINOGRAD"


_NUMPY = {data_type.FLOAT: "float32", data_type.DOUBLE: "float64", data_type.HALF: "float16",
          data_type.BFLOAT16: "bfloat16", data_type.BOOLEAN: "uint8"}  # fmt: skip
_HOST_SCALARS = {data_type.FLOAT: ctypes.c_float, data_type.INT64: ctypes.c_int64}
_POINTWISE = ("add", "relu", "relu_backward", "cmp_gt", "scale")
_ATTRIBUTES = ("padding", "stride", "dilation")  # a convolution's, among its inputs
_BUILD_ORDER = ("validate", "operation_graph", "plans", "support", "build")


class Engine:
    """One entry of a graph's ranked engine list: its name, the numerical notes cuDNN gives it,
    its workspace bytes, whether it builds, and how long a run takes (the stand-in's timer)."""

    def __init__(self, name="engine0", notes=(), workspace=64, builds=True, ms=1.0):
        self.name, self.notes, self.workspace = name, frozenset(notes), workspace
        self.builds, self.ms = builds, ms


class Handle:
    def __init__(self) -> None:
        self.stream = 0  # a fresh handle runs on the legacy default stream


def _ints(value, length, what):
    if not isinstance(value, (list, tuple)) or (length and len(value) != length):
        raise TypeError(f"{what} must be a list of {length or 'some'} ints, got {value!r}")
    if not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in value):
        raise TypeError(f"{what} must hold ints, got {value!r}")
    return [int(v) for v in value]


def _row_major(dim):
    """The frontend's default strides: row-major over dim."""
    return [int(np.prod(dim[i + 1 :])) for i in range(len(dim))]


def _no_peers(peer_stats):
    if peer_stats:
        raise NotImplementedError("batchnorm: the stand-in models no peer_stats (SyncBatchNorm)")


def _enum(value, kind, what):
    if not isinstance(value, kind):
        raise TypeError(f"{what}: expected cudnn.{kind.__name__}, got {type(value).__name__}")
    return value


class Tensor:
    def __init__(self, graph, name, dim=None, stride=None, dtype=None, by_value=False, op=None):
        self.graph, self.name, self.dim, self.stride = graph, name, dim, stride
        self.data_type, self.is_pass_by_value = dtype, by_value
        self.op, self.inputs, self.is_output = op, {}, False

    def set_output(self, value):
        self.is_output = bool(value)
        return self

    def set_dim(self, dim):
        self.dim = _ints(dim, 0, "dim")
        return self

    def set_stride(self, stride):
        self.stride = _ints(stride, len(self.dim or ()), "stride")
        return self

    def set_data_type(self, dtype):
        self.data_type = _enum(dtype, data_type, "set_data_type")
        return self


class Module:
    """The module: pygraph, create_handle, set_stream, data_type, heur_mode, and pointer() for
    its NumPy device memory. refuse(op, x_dim, x_data_type) -> bool makes check_support fail as
    cuDNN does for a shape it has no engine for."""

    Handle, cudnnGraphNotSupportedError = Handle, cudnnGraphNotSupportedError
    data_type, heur_mode, numerical_note = data_type, heur_mode, numerical_note

    def __init__(self, refuse=lambda op, dims, dtype: False, engines=None):
        self.refuse, self.graphs, self.executions = refuse, [], 0
        self.engines = list(engines or [Engine()])  # each graph's ranked list (heuristics)
        self.runs: list[str] = []  # the engine of each execute, by name
        self.capturing = False  # what Runtime.capturing reads: a CUDA graph capture under way
        self.memory: dict[int, np.ndarray] = {}  # address -> the array there ("device" memory)
        self.streams: list[int] = []  # the handle's stream at each execute

    def create_handle(self):
        return Handle()

    def set_stream(self, handle, stream):
        if not isinstance(handle, Handle):
            raise TypeError(
                "cudnn.set_stream expects a cudnn.Handle (from cudnn.create_handle()), "
                f"got {type(handle).__name__}"
            )
        if not isinstance(stream, int):
            raise TypeError(f"cudnn.set_stream expects a stream address (int), got {stream!r}")
        handle.stream = stream

    def pygraph(self, name="test_graph", io_data_type=None, intermediate_data_type=None,
                compute_data_type=None, handle=None):  # fmt: skip
        """A graph; the stand-in needs all three data types and a handle (the frontend lets
        them default and fails when it lowers the graph)."""
        for what, dt in (("io", io_data_type), ("intermediate", intermediate_data_type),
                         ("compute", compute_data_type)):  # fmt: skip
            _enum(dt, data_type, f"pygraph {what}_data_type")
        if not isinstance(handle, Handle):
            raise TypeError(f"pygraph handle: expected a cudnn handle, got {type(handle).__name__}")
        graph = Graph(self, {"io_data_type": io_data_type, "compute_data_type": compute_data_type})
        self.graphs.append(graph)
        return graph

    def backend_version(self):
        return 91900

    def timer(self, run) -> float:
        """Runtime.timer on the stand-in: run(), and the time of the engine it ran."""
        run()
        return next(e.ms for e in self.engines if e.name == self.runs[-1])

    def pointer(self, array) -> int:
        """Put a C-contiguous NumPy array on the stand-in's device: its address."""
        if not isinstance(array, np.ndarray) or not array.flags.c_contiguous:
            raise TypeError("the stand-in's device memory is C-contiguous NumPy arrays")
        address = array.__array_interface__["data"][0]
        self.memory[address] = array
        return address

    def write(self, address, tensor, result):
        """result into the memory at address as tensor declares it (a bitmask: packed)."""
        target = self.device_view(address, tensor)
        if tensor.data_type is not data_type.BOOLEAN:
            target[...] = result.astype(target.dtype)
            return
        array = self.memory[address]
        bits = np.unpackbits(array, bitorder="little").view(np.bool_)
        np.lib.stride_tricks.as_strided(bits, shape=tensor.dim, strides=tensor.stride)[...] = (
            result.astype(bool)
        )
        array[...] = np.packbits(bits, bitorder="little")

    def device_view(self, address, tensor):
        """The registered array at address as cuDNN reads it: dim over stride, bounds checked."""
        array = self.memory.get(address) if type(address) is int else None
        if array is None:
            raise ValueError(f"{tensor.name}: {address!r} is no device pointer")
        if address % ALIGNMENT:  # the frontend declares every tensor 16-byte aligned
            raise RuntimeError(f"cudaErrorMisalignedAddress: {tensor.name} at {address:#x} is not "
                               f"{ALIGNMENT}-byte aligned")  # fmt: skip
        if array.dtype.name != _NUMPY.get(tensor.data_type, "?"):
            raise TypeError(f"{tensor.name}: declared {tensor.data_type}, memory is {array.dtype}")
        extent = 1 + sum((d - 1) * s for d, s in zip(tensor.dim, tensor.stride, strict=True))
        size = array.size * 8 if tensor.data_type is data_type.BOOLEAN else array.size
        if extent > size:
            raise ValueError(f"{tensor.name}: dim/stride reach {extent} elements of {size}")
        flat = array.reshape(-1)
        if tensor.data_type is data_type.BOOLEAN:  # bits in memory order, low bit first
            flat = np.unpackbits(flat, bitorder="little").view(np.bool_)
        strides = [s * flat.itemsize for s in tensor.stride]
        return np.lib.stride_tricks.as_strided(flat, shape=tensor.dim, strides=strides)


# The byte alignment the frontend declares for every tensor (its default; a view into a flat
# vector at an odd offset is not: a real GPU stops with cudaErrorMisalignedAddress, as the
# H200 run of 2026-11-29 did for BatchNorm's gamma views)
ALIGNMENT = 16


class Graph:
    def __init__(self, module, options):
        self.module, self.options, self.ops, self.built = module, options, [], []
        self.inputs: list[Tensor] = []
        self.barred: set[int] = set()  # engines a note filter left out
        self.engines_built: set[int] = set()
        self.selected: int | None = None  # the engine execute() runs

    def tensor(self, dim, stride=None, data_type=None, is_virtual=False,  # noqa: A002
               is_pass_by_value=False, ragged_offset=None, reordering_type=None,
               name=""):  # fmt: skip
        """The frontend's tensor(): stride defaults to row-major, data_type to the graph's I/O
        type; virtual, ragged and reordered tensors are not modelled."""
        name = name or f"tensor_{len(self.inputs)}"
        if is_virtual or ragged_offset is not None or reordering_type is not None:
            raise NotImplementedError(f"{name}: the stand-in models no virtual, ragged or "
                                      "reordered tensors")  # fmt: skip
        dim = _ints(dim, 0, f"{name} dim")
        stride = _row_major(dim) if stride is None else _ints(stride, len(dim), f"{name} stride")
        dt = self.options["io_data_type"] if data_type is None else data_type
        dt = _enum(dt, globals()["data_type"], f"{name} data_type")
        t = Tensor(self, name, dim, stride, dt, bool(is_pass_by_value))
        if t.is_pass_by_value and t.dim != [1, 1, 1, 1]:
            raise ValueError(f"{name}: a pass-by-value tensor is a scalar, [1, 1, 1, 1]")
        self.inputs.append(t)
        return t

    def _op(self, op, outputs, compute_data_type=None, **inputs):
        """An op on this graph's tensors. What is no tensor fails as the frontend's tensor_like
        does on it (AttributeError without a shape); an array, which the frontend would bind as
        a tensor of its own, is refused: hpcdl declares every tensor."""
        for key, t in inputs.items():
            if key in _ATTRIBUTES or isinstance(t, Tensor) and t.graph is self:
                continue
            if isinstance(t, Tensor):
                raise ValueError(f"{op} {key}: a tensor of another graph")
            if not hasattr(t, "shape"):
                raise AttributeError(f"'{type(t).__name__}' object has no attribute 'shape'")
            raise TypeError(f"{op} {key}: expected a cudnn tensor, got {type(t).__name__}")
        if compute_data_type is not None:
            _enum(compute_data_type, data_type, f"{op} compute_data_type")
        outs = [Tensor(self, f"{op}:{i}", op=op) for i in range(outputs)]
        outs[0].inputs = inputs
        self.ops.append(outs)
        return outs[0] if outputs == 1 else outs

    def batchnorm(self, input, scale, bias, in_running_mean=None, in_running_var=None,  # noqa: A002
                  epsilon=None, momentum=None, *, peer_stats=None, name="",
                  compute_data_type=None):  # fmt: skip
        """Training BatchNorm with running statistics; epsilon and momentum passed by value."""
        _no_peers(peer_stats)
        if in_running_mean is None or in_running_var is None:
            raise NotImplementedError("batchnorm: the stand-in models running statistics only")
        for what, t in (("epsilon", epsilon), ("momentum", momentum)):
            if isinstance(t, Tensor) and not t.is_pass_by_value or t is None:
                raise TypeError(f"batchnorm {what}: a pass-by-value tensor (a host scalar)")
        return self._op("batchnorm", 5, compute_data_type, x=input, scale=scale, bias=bias,
                        rm=in_running_mean, rv=in_running_var, eps=epsilon,
                        momentum=momentum)  # fmt: skip

    def batchnorm_backward(self, grad, input, scale, mean, inv_variance, *,  # noqa: A002
                           peer_stats=None, name="", compute_data_type=None):  # fmt: skip
        _no_peers(peer_stats)
        return self._op("batchnorm_backward", 3, compute_data_type, dy=grad, x=input,
                        scale=scale, mean=mean, inv_var=inv_variance)  # fmt: skip

    def batchnorm_inference(self, input, mean, inv_variance, scale, bias, *, name="",  # noqa: A002
                            compute_data_type=None):  # fmt: skip
        return self._op("batchnorm_inference", 1, compute_data_type, x=input, mean=mean,
                        inv_var=inv_variance, scale=scale, bias=bias)  # fmt: skip

    def _pointwise(self, op, compute_data_type, clips, **inputs):
        """The frontend's pointwise ops: clips (negative_slope, lower_clip, upper_clip) are
        floats or None; the stand-in models a plain ReLU (no slope, lower clip 0)."""
        if any(c is not None and not isinstance(c, (int, float)) for c in clips):
            raise TypeError(f"{op}: clips are floats or None, got {clips!r}")
        if clips and (
            clips[0] not in (None, 0) or clips[1] not in (None, 0) or clips[2] is not None
        ):
            raise NotImplementedError(f"{op}: the stand-in models no leaky or clipped ReLU")
        return self._op(op, 1, compute_data_type, **inputs)

    def add(self, a, b, *, name="", compute_data_type=None):
        return self._pointwise("add", compute_data_type, (), a=a, b=b)

    def cmp_gt(self, input, comparison, *, name="", compute_data_type=None):  # noqa: A002
        """1 where input > comparison: with a BOOLEAN output, the bitmask of BnAddRelu."""
        return self._pointwise("cmp_gt", compute_data_type, (), input=input, comparison=comparison)

    def scale(self, input, scale, *, name="", compute_data_type=None):  # noqa: A002
        return self._pointwise("scale", compute_data_type, (), input=input, scale=scale)

    def relu(self, input, negative_slope=None, lower_clip=None, upper_clip=None, name="",  # noqa: A002
             compute_data_type=None):  # fmt: skip
        clips = (negative_slope, lower_clip, upper_clip)
        return self._pointwise("relu", compute_data_type, clips, input=input)

    def relu_backward(self, loss, input, negative_slope=None, lower_clip=None,  # noqa: A002
                      upper_clip=None, name="", compute_data_type=None):  # fmt: skip
        clips = (negative_slope, lower_clip, upper_clip)
        return self._pointwise("relu_backward", compute_data_type, clips, loss=loss, input=input)

    def _conv(self, op, ports, attributes, compute_data_type):
        padding, pre, post, stride, dilation = attributes
        if padding is None and pre is not None and post is not None:
            if _ints(pre, 2, f"{op} pre_padding") != _ints(post, 2, f"{op} post_padding"):
                raise NotImplementedError(f"{op}: the stand-in models no asymmetric padding")
            padding = pre
        named = (("padding", padding), ("stride", stride), ("dilation", dilation))
        for key, value in named:
            if value is None:
                raise ValueError(f"{op}: {key} not set")
        conv = {key: _ints(value, 2, f"{op} {key}") for key, value in named}
        return self._op(op, 1, compute_data_type, **ports, **conv)

    def conv_fprop(self, image, weight, padding=None, pre_padding=None, post_padding=None,
                   stride=None, dilation=None, *, name="", compute_data_type=None):  # fmt: skip
        attributes = (padding, pre_padding, post_padding, stride, dilation)
        return self._conv("conv_fprop", {"x": image, "w": weight}, attributes, compute_data_type)

    def conv_dgrad(self, loss, filter, padding=None, pre_padding=None, post_padding=None,  # noqa: A002
                   stride=None, dilation=None, *, name="", compute_data_type=None):  # fmt: skip
        attributes = (padding, pre_padding, post_padding, stride, dilation)
        return self._conv("conv_dgrad", {"dy": loss, "w": filter}, attributes, compute_data_type)

    def conv_wgrad(self, image, loss, padding=None, pre_padding=None, post_padding=None,
                   stride=None, dilation=None, *, name="", compute_data_type=None):  # fmt: skip
        attributes = (padding, pre_padding, post_padding, stride, dilation)
        return self._conv("conv_wgrad", {"x": image, "dy": loss}, attributes, compute_data_type)

    def _step(self, name):
        expected = _BUILD_ORDER[len(self.built)] if len(self.built) < len(_BUILD_ORDER) else None
        if name != expected:
            raise RuntimeError(f"{name} called out of order; the graph is at {self.built}")

    def validate(self):
        self._step("validate")
        for outs in self.ops:
            for out in outs:
                if out.is_output and (out.dim is None or out.stride is None):
                    raise ValueError(f"{out.name}: an output needs its dim and stride")
        self.built.append("validate")

    def build_operation_graph(self):
        self._step("operation_graph")
        self.built.append("operation_graph")

    def create_execution_plans(self, heuristics=None):
        self._step("plans")
        for mode in heuristics or ():
            _enum(mode, heur_mode, "create_execution_plans")
        self.built.append(("plans", tuple(m.value for m in heuristics or ())))

    def deselect_numeric_notes(self, notes):
        """Leaves out the engines carrying any of `notes` (recorded in `built`). Only between
        create_execution_plans and check_support: the backend's filter marks indices into the
        plans' engine configs, so one set before them has nothing to mark."""
        if not self.built or not isinstance(self.built[-1], tuple) or self.built[-1][0] != "plans":
            raise RuntimeError(
                f"deselect_numeric_notes called out of order; the graph is at {self.built}"
            )
        if not isinstance(notes, (list, tuple)):
            raise TypeError(f"deselect_numeric_notes takes a list, got {type(notes).__name__}")
        names = tuple(_enum(n, numerical_note, "deselect_numeric_notes").value for n in notes)
        self.built[-1] = (*self.built[-1], ("deselect", names))
        self.barred |= {i for i, e in enumerate(self.module.engines) if e.notes & set(names)}
        return self

    def check_support(self):
        self._step("support")
        for outs in self.ops:
            _support(self.module, outs[0])
        if len(self.barred) == len(self.module.engines):
            raise cudnnGraphNotSupportedError("No valid engine configs (every one deselected)")
        self.built.append("support")

    def get_execution_plan_count(self):
        """The ranked list's length, deselected engines included (their indices stay); an
        unplanned graph has none."""
        return len(self.module.engines) if len(self.built) >= 3 else 0

    def get_plan_name_at_index(self, index):
        return self.module.engines[self._index(index)].name

    def build_plan_at_index(self, index):
        """Build the engine at index and select it (execute() runs it)."""
        if "support" not in self.built:
            raise RuntimeError(f"build_plan_at_index before check_support; at {self.built}")
        engine = self.module.engines[self._index(index)]
        if not engine.builds:
            raise cudnnGraphNotSupportedError(f"{engine.name} does not build for this graph")
        self.engines_built.add(index)
        self.selected = index
        if "build" not in self.built:
            self.built.append("build")
        return self

    def build_plans(self, *, ctx=None):
        """The frontend's walk: select the first engine that builds, or raise why none does."""
        if "build" not in self.built:
            self._step("build")
        for index in range(len(self.module.engines)):
            try:
                return self.build_plan_at_index(index)
            except (ValueError, cudnnGraphNotSupportedError):
                continue
        raise cudnnGraphNotSupportedError("no plan in the list could be built")

    def _index(self, index, built=False):
        """index into the ranked list: in range, not deselected, and built where it must be."""
        if type(index) is not int or not 0 <= index < len(self.module.engines):
            raise IndexError(f"plan index {index!r} out of range for "
                             f"{len(self.module.engines)} plan(s)")  # fmt: skip
        if index in self.barred:
            raise ValueError(f"plan {index} is excluded by a note filter")
        if built and index not in self.engines_built:
            raise RuntimeError(f"plan {index} is not built")
        return index

    def get_workspace_size(self, handle=None):
        if self.selected is None:
            raise RuntimeError("Call build() first")
        return self.module.engines[self.selected].workspace

    def get_workspace_size_plan_at_index(self, index, handle=None):
        return self.module.engines[self._index(index)].workspace

    def execute(self, tensor_dict, workspace=None, handle=None):
        if "build" not in self.built or self.selected is None:
            raise RuntimeError("execute before build_plans")
        self._run(tensor_dict, workspace, handle, self.selected)

    def execute_plan_at_index(self, tensor_dict, workspace=None, index=0, handle=None):
        self._run(tensor_dict, workspace, handle, self._index(index, built=True))

    def _run(self, tensor_dict, workspace, handle, index):
        if not isinstance(handle, Handle):
            raise TypeError(f"execute handle: expected a cudnn handle, got {type(handle).__name__}")
        values = self._pointers(tensor_dict)
        engine = self.module.engines[index]
        space = self.module.memory.get(workspace) if type(workspace) is int else None
        if space is None or space.nbytes < engine.workspace:
            raise ValueError(f"workspace: {workspace!r} is no device buffer of >= "
                             f"{engine.workspace} bytes ({engine.name})")  # fmt: skip
        self.module.executions += 1
        self.module.streams.append(handle.stream)
        self.module.runs.append(engine.name)
        virtual = {}  # an op's results that the next ops read (no memory of their own)
        for outs in self.ops:
            args = {k: (_operand(t, values, virtual) if isinstance(t, Tensor) else t)
                    for k, t in outs[0].inputs.items()}  # fmt: skip
            results = globals()[f"_{outs[0].op}"](args, outs[0].dim)
            for out, result in zip(outs, results if len(outs) > 1 else [results], strict=True):
                if out.data_type in _NUMPY and out.data_type is not data_type.BOOLEAN:
                    result = result.astype(_NUMPY[out.data_type]).astype(np.float64)  # typed
                virtual[out] = result
                if out.is_output:
                    self.module.write(values[out], out, result)

    def _pointers(self, tensor_dict):
        """tensor -> address, refusing what the frontend's variant-pack normalisation refuses.
        Keys are tensors or their names (a name no tensor has: KeyError, as the frontend's);
        the stand-in has no uids, and refuses another graph's tensor, whose uid the frontend
        would take for whichever tensor of this graph has it."""
        needed = self.inputs + [t for outs in self.ops for t in outs if t.is_output]
        names = {t.name: t for t in needed}
        pack = {names[k] if isinstance(k, str) else k: v for k, v in tensor_dict.items()}
        for key, value in pack.items():
            if not isinstance(key, Tensor) or key.graph is not self:
                raise ValueError(f"variant pack key {key!r} is no tensor of this graph")
            if isinstance(value, np.ndarray):  # DLPack with a stream, as the frontend asks
                raise ValueError("NumPy only supports stream=None.")
            if type(value) is not int:
                raise TypeError(f"{key.name}: a variant-pack value is an address, got {value!r}")
        for t in needed:
            if t not in pack:
                raise ValueError(f"the variant pack is missing a buffer for tensor {t.name!r}")
        return {t: (_Host(pack[t], t, self.module) if t.is_pass_by_value else pack[t])
                for t in needed}  # fmt: skip


class _Host:
    """A pass-by-value operand: the backend reads the scalar at a host address at execute."""

    def __init__(self, address, tensor, module):
        if address in module.memory:
            raise ValueError(f"{tensor.name}: pass-by-value takes a host address, got a device one")
        if address < 4096 or tensor.data_type not in _HOST_SCALARS:
            raise ValueError(f"{tensor.name}: {address} is no host {tensor.data_type} scalar")
        self.value = _HOST_SCALARS[tensor.data_type].from_address(address).value


def _operand(tensor, values, virtual):
    """An op's operand: a graph input or output read from memory, or an earlier op's result
    (_op takes only this graph's tensors, so each is one or the other)."""
    return _read(values[tensor], tensor) if tensor in values else virtual[tensor]


def _read(value, tensor):
    if isinstance(value, _Host):
        return np.full((1, 1, 1, 1), value.value)
    return tensor.graph.module.device_view(value, tensor)


def _support(module, out):
    """Refuse a graph no engine runs: mixed I/O types, non-FLOAT statistics, refuse()."""
    tensors = {k: t for k, t in out.inputs.items() if isinstance(t, Tensor)}
    declared = [t for t in tensors.values() if t.dim is not None and t.data_type is not None]
    if out.op == "cmp_gt" and out.data_type is not data_type.BOOLEAN:
        raise cudnnGraphNotSupportedError("cmp_gt: a bitmask output is typed BOOLEAN")
    if out.op == "batchnorm_backward":
        _norm_prologue(tensors["dy"])
    if out.op in _POINTWISE:  # refuse(op, None, None) where no operand is declared
        dims, dtype = (declared[0].dim, declared[0].data_type.value) if declared else (None, None)
        if module.refuse(out.op, dims, dtype):
            raise cudnnGraphNotSupportedError(f"no engine fuses {out.op} here")
        return
    first = declared[0]
    if out.op.startswith("conv"):
        io = {t.data_type for t in tensors.values()}
        if len(io) > 1:
            raise cudnnGraphNotSupportedError(
                f"{out.op}: operands in {sorted(d.value for d in io)}"
            )
    else:
        stats = [t for k, t in tensors.items() if k not in ("x", "dy", "eps", "momentum")]
        if any(t.data_type not in (data_type.FLOAT, None) for t in stats):
            raise cudnnGraphNotSupportedError(f"{out.op}: statistics must be FLOAT")
    if module.refuse(out.op, first.dim, first.data_type.value):
        raise cudnnGraphNotSupportedError(
            f"no engine for {out.op} {first.dim}\nWarning: CUDNN_STATUS_NOT_SUPPORTED; Reason: "
            "finalize_internal()"
        )


def _norm_prologue(grad):
    """What cuDNN's norm engines fuse before BatchNorm's backward (the frontend's samples):
    nothing (grad a tensor of the graph), the ReLU's backward over batchnorm_inference's
    recomputed output (DReluForkDBn), or the loss scaled by a BOOLEAN bitmask (BnAddRelu);
    the fused result typed. Anything else found no engine on the H200 (2026-11-29)."""
    if grad.op is None:
        return
    ports = grad.inputs
    fork = grad.op == "relu_backward" and getattr(ports["input"], "op", "") == "batchnorm_inference"
    mask = ports.get("scale")
    bitmask = grad.op == "scale" and mask.op is None and mask.data_type is data_type.BOOLEAN
    if not (fork or bitmask) or grad.data_type is None:
        raise cudnnGraphNotSupportedError(
            "no engine — python or backend — proposed a plan for this graph (the backend "
            f"declined: No valid engine configs for {grad.op} -> batchnorm_backward)"
        )


def _padded(x, padding):
    ph, pw = padding
    return np.pad(x.astype(np.float64), ((0, 0), (0, 0), (ph, ph), (pw, pw)))


def _conv_fprop(a, y_dim):
    x, w = _padded(a["x"], a["padding"]), a["w"].astype(np.float64)
    (sh, sw), (_, _, ho, wo) = a["stride"], y_dim
    y = np.zeros(y_dim)
    for r in range(w.shape[2]):
        for s in range(w.shape[3]):
            patch = x[:, :, r : r + sh * ho : sh, s : s + sw * wo : sw]
            y += np.einsum("nchw,kc->nkhw", patch, w[:, :, r, s])
    return y


def _conv_dgrad(a, x_dim):
    dy, w = a["dy"].astype(np.float64), a["w"].astype(np.float64)
    (ph, pw), (sh, sw) = a["padding"], a["stride"]
    n, c, h, wd = x_dim
    dx = np.zeros((n, c, h + 2 * ph + sh, wd + 2 * pw + sw))
    ho, wo = dy.shape[2:]
    for r in range(w.shape[2]):
        for s in range(w.shape[3]):
            dx[:, :, r : r + sh * ho : sh, s : s + sw * wo : sw] += np.einsum(
                "nkhw,kc->nchw", dy, w[:, :, r, s]
            )
    return dx[:, :, ph : ph + h, pw : pw + wd]


def _conv_wgrad(a, w_dim):
    x, dy = _padded(a["x"], a["padding"]), a["dy"].astype(np.float64)
    (sh, sw), (ho, wo) = a["stride"], dy.shape[2:]
    dw = np.zeros(w_dim)
    for r in range(w_dim[2]):
        for s in range(w_dim[3]):
            patch = x[:, :, r : r + sh * ho : sh, s : s + sw * wo : sw]
            dw[:, :, r, s] = np.einsum("nchw,nkhw->kc", patch, dy)
    return dw


def _batchnorm(a, _):
    """(y, mean, inv_var, running mean, running var) over (N, C, H, W), PyTorch's rule: the
    running variance takes the unbiased batch variance."""
    x, eps, mom = a["x"].astype(np.float64), float(a["eps"].flat[0]), float(a["momentum"].flat[0])
    m = x.size // x.shape[1]
    mean, var = x.mean(axis=(0, 2, 3), keepdims=True), x.var(axis=(0, 2, 3), keepdims=True)
    inv = 1.0 / np.sqrt(var + eps)
    y = (x - mean) * inv * a["scale"] + a["bias"]
    rm = (1 - mom) * a["rm"] + mom * mean
    rv = (1 - mom) * a["rv"] + mom * var * m / (m - 1)
    return y, mean, inv, rm, rv


def _batchnorm_backward(a, _):
    """(dx, dscale, dbias) of the training forward."""
    dy, x = a["dy"].astype(np.float64), a["x"].astype(np.float64)
    xhat = (x - a["mean"]) * a["inv_var"]
    dbias = dy.sum(axis=(0, 2, 3), keepdims=True)
    dscale = (dy * xhat).sum(axis=(0, 2, 3), keepdims=True)
    m = x.size // x.shape[1]
    dx = a["scale"] * a["inv_var"] * (dy - dbias / m - xhat * dscale / m)
    return dx, dscale, dbias


def _batchnorm_inference(a, _):
    return (a["x"].astype(np.float64) - a["mean"]) * a["inv_var"] * a["scale"] + a["bias"]


def _cmp_gt(a, _):
    return a["input"] > a["comparison"]


def _scale(a, _):
    return a["input"].astype(np.float64) * a["scale"]


def _add(a, _):
    return a["a"].astype(np.float64) + a["b"]


def _relu(a, _):
    return np.maximum(a["input"].astype(np.float64), 0.0)


def _relu_backward(a, _):
    """The loss where the forward input was > 0 (lower_clip 0), else 0."""
    return np.where(a["input"] > 0, a["loss"].astype(np.float64), 0.0)


def install(monkeypatch, module: Module, stream: int = 1, batch_norm: bool = True,
            enable: bool = False) -> Module:  # fmt: skip
    """module as the process's cuDNN on NumPy arrays until monkeypatch undoes it, with fresh
    kernels (plan caches): Conv2d's, and BatchNorm's (the fused one first) unless batch_norm is
    False; enable: --gpu-kernels on."""
    from hpcdl.nn import kernels  # noqa: PLC0415
    from hpcdl.nn.kernels import batchnorm, conv, cudnn_graphs  # noqa: PLC0415

    runtime = cudnn_graphs.Runtime(
        module,
        pointer=module.pointer,
        is_device=lambda a: True,
        stream=lambda: stream,
        capturing=lambda: module.capturing,
        timer=module.timer,
    )
    monkeypatch.setattr(cudnn_graphs, "_RUNTIME", runtime)
    monkeypatch.setattr(cudnn_graphs, "_LOADED", True)
    monkeypatch.setattr(conv, "KERNELS", [conv.CudnnConv()])
    if batch_norm:
        fused = [batchnorm.CudnnBatchNormRelu(), batchnorm.CudnnBatchNorm()]
        monkeypatch.setattr(batchnorm, "KERNELS", fused)
    if enable:
        monkeypatch.setattr(kernels, "_enabled", True)
    return module
