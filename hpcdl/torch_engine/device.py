"""Where the torch engine's batches and arithmetic run: the host, or a CUDA device.

NOTE [torch engine batches on a device]
hpcdl's loader yields NumPy batches in its shared-memory slots. On the CPU, BatchFeed hands
them on as tensors that share that memory (torch.from_numpy: no copy). On a CUDA device, as
hpcdl.torch.Loader does for scripts (NOTE [pinned hand-off] in hpcdl/torch/pinning.py), a
thread copies each batch into page-locked memory and frees the slot (hpcdl.data.ahead). The
feed issues each batch's host-to-device copy on its own CUDA stream one batch ahead, so the
copy of batch k+1 overlaps step k, and hands batch k over once the step's stream waits for its
copy (an event, no host sync); record_stream tells the caching allocator which stream uses the
device tensors last. Images go channels_last where it helps (a GPU and a model with 2-D
convolutions: cuDNN's NHWC kernels, the Tensor Cores' layout under bf16); the weights stay
contiguous, for they are views of the engine's flat vectors (hpcdl/torch_engine/flat.py).

With `--decode gpu` the loader's workers read file bytes only and the rank decodes each batch
(NOTE [GPU decode] in hpcdl/data/gpu_decode.py): on the CPU into NumPy (Pillow), handed on as
above; on a GPU into CuPy arrays on the rank's device, which become tensors through DLPack
(torch.from_dlpack: the same memory, no copy); a NumPy array among them (labels, say) is
copied to the device. Three streams are involved: the decoder's side stream, where a thread
decodes and crops one batch ahead; torch's current stream, where the step runs; and CuPy's
current stream in the rank's thread, which the decoder's hand-over uses: it makes that stream
wait for the batch's `ready` event and records its `taken` event there (the side stream waits
for `taken` before reusing memory that batches the step is done with). BatchFeed takes each
batch with CuPy's current stream set to torch's current stream (an ExternalStream of the same
handle), so the wait and the record land on the step's own stream: the step's kernels are
queued after the decode has finished (device-side, no host sync), and the decoder reuses a
batch's memory only after the step's kernels that read it. DLPack's own hand-over then has
nothing to order (producer and consumer stream are one). channels_last is a copy on the
step's stream.

precision() is torch.autocast for the device's kind, bf16 or fp16, on CUDA and on the CPU;
parameters and gradients stay float32.

On the CPU torch's intra-op pool starts one thread per core of the node, whatever the rank's
CPU mask; R ranks of a node would run R x cores threads on the same cores. use_cpu_threads sets
it by hpcdl.comm.blas_threads' rule (the mask, shared by the ranks whose masks overlap; an
explicit OMP_NUM_THREADS wins, up to the mask), the threads hpcdl's own layers get.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hpcdl.comm import blas_threads
from hpcdl.data.ahead import Ahead

AHEAD = 2  # pinned batches queued: as hpcdl.torch.pinning (which is a layer above this one)


def use_cpu_threads(node_comm: Any, env: Mapping[str, str] | None = None) -> int:
    """Set torch's intra-op threads for this rank (module notes); collective on node_comm.
    Returns them."""
    mine = blas_threads.affinity()
    choice = blas_threads.choose(
        mine, node_comm.allgather(mine), os.environ if env is None else env
    )
    torch.set_num_threads(choice.threads)
    return choice.threads


NO_CUDA = (
    "--device gpu with a torch model (--model {model}) needs a CUDA device, and torch sees "
    "none (torch.cuda.is_available() is False: a CPU build of torch, or no GPU visible on this "
    "node); run on a GPU node with a CUDA build of torch, or with --device cpu"
)


def cuda_index(local_rank: int, visible: int) -> int:
    """The CUDA device of a rank: local_rank % visible devices, as hpcdl.backend.select binds
    CuPy (so torch, CuPy and the reducer's thread use one device)."""
    return local_rank % visible


def torch_device(asked: str, model: str, local_rank: int) -> tuple[torch.device, str | None]:
    """(the device this rank trains on, None), or (the CPU, the one line why not) for
    --device gpu where torch sees no CUDA device. Binds torch's current device."""
    if asked != "gpu":
        return torch.device("cpu"), None
    if not torch.cuda.is_available():
        return torch.device("cpu"), NO_CUDA.format(model=model)
    index = cuda_index(local_rank, torch.cuda.device_count())
    torch.cuda.set_device(index)
    return torch.device("cuda", index), None


def as_array(tensor: torch.Tensor) -> Any:
    """The array hpcdl's reducer, collectives and checkpoints read: NumPy on the CPU, CuPy on a
    GPU (DLPack), both sharing the tensor's memory (hpcdl.torch.optimizer's _array)."""
    if tensor.device.type == "cpu":
        return tensor.numpy()
    import cupy  # noqa: PLC0415 (startup's backend.select needed it for --device gpu)

    return cupy.from_dlpack(tensor)


def torch_stream_in_cupy(device: torch.device, known: Any = None) -> Any:
    """CuPy's view of torch's current stream on device (an ExternalStream of the same handle),
    for `with` around CuPy work that must queue there; known, a view made before, is returned
    while torch's current stream is still its."""
    import cupy  # noqa: PLC0415 (a CUDA device: startup's backend.select needed it)

    stream = torch.cuda.current_stream(device)
    if known is not None and known.ptr == stream.cuda_stream:
        return known
    return cupy.cuda.ExternalStream(stream.cuda_stream, device.index)


class OnTorchStream:
    """mark_ready called with CuPy's current stream made torch's current one: the reducer's
    ready event, recorded on CuPy's current stream, then follows the kernels backward queued
    for the bucket's gradients on torch's, so the reducer hands MPI (or the host copy) a bucket
    only once they have finished. An event on CuPy's default stream would not follow them
    under a script's own torch.cuda.Stream(), and the reducer could read a bucket before its
    gradients land. The torch engine's and hpcdl.torch's DistributedOptimizer's (GPU)."""

    def __init__(self, mark_ready: Callable[[int], None], device: torch.device) -> None:
        self.mark_ready, self.device = mark_ready, device
        self._stream: Any = None

    def __call__(self, n: int) -> None:
        self._stream = torch_stream_in_cupy(self.device, self._stream)
        with self._stream:
            self.mark_ready(n)


def use_channels_last(module: torch.nn.Module, device: torch.device) -> bool:
    """channels_last pays on a CUDA device for a model with 2-D convolutions; not on the CPU
    (the engine's flat parameter views must keep their layout there) nor for a dense model."""
    if device.type != "cuda":
        return False
    return any(isinstance(m, torch.nn.Conv2d) for m in module.modules())


def set_fp32_precision(tf32: bool) -> str:
    """torch's float32 convolutions (cuDNN's, RNNs' too) and matmuls on TF32 tensor cores
    ("tf32") or in IEEE float32 ("ieee"), both alike (NOTE [TF32] in hpcdl/nn/kernels/
    __init__.py); returns the value set. Through the fp32_precision settings where torch has
    them (2.9 and later: reading the older allow_tf32 flags after a mix of the two raises),
    else the allow_tf32 flags."""
    value = "tf32" if tf32 else "ieee"
    cudnn = torch.backends.cudnn
    if hasattr(getattr(cudnn, "conv", None), "fp32_precision"):
        cudnn.conv.fp32_precision = cudnn.rnn.fp32_precision = value
        torch.backends.cuda.matmul.fp32_precision = value
    else:
        cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = tf32
    return value


def precision(device: torch.device, dtype: torch.dtype | None) -> Any:
    """torch.autocast of dtype (bfloat16 or float16) for device's kind; None: nothing."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def _pinned(batch: tuple[Any, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    images, labels = batch
    return torch.from_numpy(images).pin_memory(), torch.from_numpy(labels).pin_memory()


@dataclass
class BatchFeed:
    """The loader's (images, labels) batches as tensors on device (module notes): NumPy from
    the workers, or, decoded in the rank (--decode gpu), CuPy or NumPy arrays."""

    device: torch.device
    channels_last: bool = False

    def __call__(
        self, batches: Iterable, decoded: bool = False
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if self.device.type == "cpu":
            return ((torch.from_numpy(x), torch.from_numpy(y)) for x, y in batches)
        if decoded:
            return self._from_decoder(batches)
        return self._on_device(Ahead(batches, _pinned, AHEAD, "hpcdl-pin-memory"))

    def _from_decoder(self, batches: Iterable) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Batches decoded in the rank, taken on torch's current stream (module notes)."""
        on_step = torch_stream_in_cupy(self.device)
        source = iter(batches)
        try:
            while True:
                with on_step:  # the decoder's hand-over waits and records on the step's stream
                    batch = next(source, None)
                    if batch is None:
                        return
                    images, labels = self._tensor(batch[0]), self._tensor(batch[1])
                if self.channels_last:
                    images = images.contiguous(memory_format=torch.channels_last)
                yield images, labels
        finally:
            close = getattr(source, "close", None)
            if close is not None:
                close()

    def _tensor(self, array: Any) -> torch.Tensor:
        """A decoded array on the device: NumPy copied there, CuPy's memory shared."""
        if isinstance(array, np.ndarray):
            return torch.from_numpy(array).to(self.device)
        return torch.from_dlpack(array)

    def _on_device(self, pinned: Iterable) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        copies = torch.cuda.Stream(self.device)
        pending = None
        for images, labels in pinned:
            ready = self._copy(images, labels, copies)
            if pending is not None:
                yield self._hand_over(*pending)
            pending = ready
        if pending is not None:
            yield self._hand_over(*pending)

    def _copy(self, images: torch.Tensor, labels: torch.Tensor, stream: Any) -> tuple:
        """Enqueue the batch's copy on stream; (images, labels, event recorded after it)."""
        layout = torch.channels_last if self.channels_last else torch.contiguous_format
        with torch.cuda.stream(stream):
            x = images.to(self.device, non_blocking=True, memory_format=layout)
            y = labels.to(self.device, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        return x, y, done

    def _hand_over(self, x: torch.Tensor, y: torch.Tensor, done: Any) -> tuple:
        """The step's stream waits for the copy (no host sync) and owns the tensors after."""
        current = torch.cuda.current_stream(self.device)
        current.wait_event(done)
        x.record_stream(current)
        y.record_stream(current)
        return x, y
