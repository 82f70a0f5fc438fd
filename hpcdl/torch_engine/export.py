"""A torch engine's checkpoint out as the user's own module's files: `python -m hpcdl.export
CKPT --to torch|safetensors|onnx OUT` (hpcdl.export) for a run of a torch.nn.Module.

The module is rebuilt as the run built it (its --model spec: a user's FILE.py:FN or
`torchvision:NAME`, for the run's input shape and the classifier's class count) and laid out as
the engine lays it (FlatModule), so the checkpoint's parameter and buffer vectors fill it in
place; the integer buffers (BatchNorm's num_batches_tracked) come from rank 0's saved state.
Its state_dict() then has every key the user's module has, parameters and buffers, and the
user's module loads the file with load_state_dict (strict).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from hpcdl import checkpoint
from hpcdl.config import TrainConfig
from hpcdl.nn.weights_io import optional_import, write_new_file, write_state
from hpcdl.torch_engine.flat import FlatModule
from hpcdl.torch_engine.specs import torchvision_model


def rebuild(
    ckpt: checkpoint.Checkpoint,
    path: str,
    spec: str,
    shape: tuple[int, ...],
    num_classes: int,
    built: Any,
    moved: bool = False,
) -> Any:
    """The checkpoint's module (eval mode) holding its parameters and statistics; ValueError
    (one line) when it does not fit the checkpoint. built: the module spec's builder returned
    for (shape, num_classes), None for `torchvision:NAME` (built here). moved: spec is a
    builder of another name than the checkpoint's, held to its parameters' names and shapes."""
    cfg = TrainConfig(data=str(ckpt.config.get("data", "")), model=spec)
    module = built if built is not None else torchvision_model(cfg, num_classes)
    model = FlatModule(module, cfg, tuple(shape), num_classes)
    layout = [(name, tuple(s)) for name, s, _ in model.layout()]
    if moved:
        checkpoint.check_same_arrays(ckpt, path, spec, layout)
    name = ckpt.model if moved else model.name
    checkpoint.check_compatible(ckpt, path, name, layout, buffer_values=int(model.buffers.size))
    model.params[...] = ckpt.params
    model.buffers[...] = ckpt.buffers
    counters = (ckpt.rng_states[0] or {}).get("counters", {}) if ckpt.rng_states else {}
    for name, tensor in model.counters:
        if name in counters:
            tensor.fill_(int(counters[name]))
    return module.eval()


def write(module: Any, to: str, out: str, shape: tuple[int, ...]) -> None:
    """module's state_dict as a .pth (torch.save) or safetensors file, or its inference graph
    as ONNX (torch.onnx.export, input (batch, *shape), the batch dimension free)."""
    state = {key: t.detach().clone().contiguous() for key, t in module.state_dict().items()}
    if to == "torch":
        write_new_file(out, lambda tmp: torch.save(state, tmp))
    elif to == "safetensors":
        write_state({k: np.ascontiguousarray(t.numpy()) for k, t in state.items()}, out, to)
    else:
        optional_import("onnx", "export", f"writing {out}")
        sample = torch.zeros((1, *shape), dtype=torch.float32)
        write_new_file(out, lambda tmp: _onnx(module, sample, tmp))


def _onnx(module: Any, sample: Any, path: str) -> None:
    """torch.onnx.export's TorchScript exporter (no onnxscript needed), batch dimension free."""
    with torch.no_grad():
        torch.onnx.export(
            module,
            (sample,),
            path,
            input_names=["input"],
            output_names=["logits"],
            dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}},
            dynamo=False,
        )
