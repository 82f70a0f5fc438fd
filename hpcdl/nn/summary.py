"""A model's summary: one row per top-level layer with its output shape and parameter count.

Output shapes come from a forward pass of ONE zero sample in evaluation mode, layer by layer,
on the model's own backend: it works for any layer (a user's too) without each layer having
to know its output shape, and evaluation mode neither updates the BatchNorm running statistics
nor draws dropout masks, so a model is the same after its summary as before. A 3x224x224
ResNet-50 takes about a second on one CPU core.

Rows are named '<index>.<Class>', the prefix of the names of their parameters in
`model.layout()` (e.g. row '4.BottleneckBlock' holds '4.branch.0.Conv2d.W'). Parameters are
what the optimizer trains; buffers (BatchNorm running mean and variance) are counted apart, as
torchvision's `model.parameters()` and `model.buffers()` are.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from hpcdl.backend import array_module
from hpcdl.nn.layers import Layer
from hpcdl.nn.model import Model


@dataclass(frozen=True)
class LayerRow:
    """One top-level layer of a model."""

    name: str  # '<index>.<Class>'
    output_shape: tuple[int, ...]  # of one sample: (C, H, W) or (features,)
    parameters: int
    buffers: int


class ActivationMemoryError(ValueError):
    """One sample's activations do not fit in this machine's memory (one line, with GiB)."""


def layer_rows(model: Model) -> list[LayerRow]:
    """One LayerRow per top-level layer, in forward order; ValueError naming the layer that
    cannot take its input (one line), ActivationMemoryError when memory runs out."""
    c, h, w = model.input_shape
    xp = array_module(model.params)
    # (1, H, W, C): Model.forward transposes its (N, C, H, W) input once; the layers run
    # channels-last.
    try:
        x = xp.zeros((1, h, w, c), dtype=model.dtype)
    except MemoryError:
        need = h * w * c * np.dtype(model.dtype).itemsize
        raise ActivationMemoryError(
            f"one sample's activations would need {need / 2**30:.1f} GiB for the input alone, "
            "more than this machine can allocate"
        ) from None
    rows = []
    for i, layer in enumerate(model.body.layers):
        name = f"{i}.{type(layer).__name__}"
        try:
            x = layer.forward(x, train=False)
        except MemoryError as exc:  # numpy's says how much it asked for; others may not
            need = getattr(exc, "_total_size", 0)
            raise ActivationMemoryError(
                f"layer {name} given input {sample_shape(x.shape)} would need "
                + (f"{need / 2**30:.1f} GiB, " if need else "")
                + "more memory than this machine can allocate"
            ) from None
        except Exception as exc:  # a user's layer may raise anything: one line, named
            raise ValueError(
                f"layer {name} cannot take input {sample_shape(x.shape)}: {error_line(exc)}"
            ) from None
        parameters, buffers = count(layer.leaves())
        rows.append(LayerRow(name, sample_shape(x.shape), parameters, buffers))
    return rows


def count(leaves: Iterable[Layer]) -> tuple[int, int]:
    """(parameters, buffer values) that these leaf layers declare."""
    parameters = buffers = 0
    for leaf in leaves:
        parameters += sum(int(np.prod(spec.shape)) for spec in leaf.param_specs)
        buffers += sum(int(np.prod(shape)) for _, shape, _ in leaf.buffer_specs)
    return parameters, buffers


def sample_shape(batch_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of one sample of a batch inside the model: (N, H, W, C) -> (C, H, W)."""
    if len(batch_shape) == 4:
        _, h, w, c = batch_shape
        return (int(c), int(h), int(w))
    return tuple(int(d) for d in batch_shape[1:])


def summary_record(model: Model, rows: list[LayerRow]) -> dict[str, Any]:
    """The JSON-able summary: model, input_shape, num_classes, parameters, buffers, layers."""
    parameters, buffers = count(model.body.leaves())
    return {
        "model": model.name,
        "input_shape": list(model.input_shape),
        "num_classes": model.num_classes,
        "parameters": parameters,
        "buffers": buffers,
        "layers": [{**asdict(row), "output_shape": list(row.output_shape)} for row in rows],
    }


def summary_table(record: dict[str, Any]) -> str:
    """A Keras-style table of a summary_record: layer, output shape, parameters; totals."""
    header = ("Layer", "Output shape", "Param #")
    cells = [
        (row["name"], str(tuple(row["output_shape"])), f"{row['parameters']:,}")
        for row in record["layers"]
    ]
    widths = [max(len(r[i]) for r in [header, *cells]) for i in range(3)]
    ruler = "-" * (sum(widths) + 4)

    def line(cell: tuple[str, str, str]) -> str:
        return f"{cell[0]:<{widths[0]}}  {cell[1]:<{widths[1]}}  {cell[2]:>{widths[2]}}"

    c, h, w = record["input_shape"]
    dtype_bytes = 4  # the trainer's float32
    lines = [
        f"Model: {record['model']}  input (C, H, W) = ({c}, {h}, {w}), "
        f"{record['num_classes']} classes",
        ruler,
        line(header),
        ruler.replace("-", "="),
        *(line(cell) for cell in cells),
        ruler.replace("-", "="),
        f"Parameters: {record['parameters']:,} "
        f"({record['parameters'] * dtype_bytes / 2**20:.1f} MiB in float32)",
        f"Buffers:    {record['buffers']:,} (BatchNorm running statistics, not trained)",
    ]
    return "\n".join(lines)


def error_line(exc: BaseException) -> str:
    """'Type: first line of the message', for one-line reports of errors in a user's code."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else '(no message)'}"


def parse_shape(text: str) -> tuple[int, int, int]:
    """'C,H,W' -> (C, H, W); ValueError naming the flag unless three positive integers."""
    try:
        shape = tuple(int(v) for v in text.split(","))
    except ValueError:
        shape = ()
    if len(shape) != 3 or min(shape) < 1:
        raise ValueError(f"--input-shape must be C,H,W (three positive integers), got {text!r}")
    return shape  # type: ignore[return-value]
