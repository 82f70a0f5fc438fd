"""An hpcdl Model as an ONNX inference graph, built with the `onnx` package's helper API.

One emitter per layer type walks the model's layers in forward order; the weights are the
model's name map (hpcdl.nn.weight_names) in PyTorch's layout, stored as initializers under
their state-dict keys. The graph is the model in evaluation mode, channels-first like
PyTorch's: input "input" (N, C, H, W) float32 with N free, output "logits" (N, classes).
BatchNorm is explicit (BatchNormalization with the running statistics, not folded), so the
graph's weights are exactly the exported state dict's. Dropout is the identity in evaluation
and emits nothing. A layer type without an emitter (a user's own Layer subclass) is one error
naming the layer. Needs `onnx` (the `export` extra); onnxruntime runs the result.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from hpcdl.nn.blocks import OptionAShortcut, ResidualBlock, Sequential
from hpcdl.nn.conv import Conv2d
from hpcdl.nn.layers import Dropout, Flatten, GlobalAvgPool, Layer, Linear, MaxPool2d, ReLU
from hpcdl.nn.model import Model
from hpcdl.nn.norm import BatchNorm
from hpcdl.nn.weight_names import weight_names
from hpcdl.nn.weights_io import optional_import

OPSET = 17
IR_VERSION = 8  # what onnxruntime >= 1.14 reads; the ops used are all in opset 17


class _Graph:
    """The nodes and initializers being built, and the model's weights by (leaf, attr)."""

    def __init__(self, onnx: Any, model: Model, weights: dict[str, np.ndarray]) -> None:
        self.onnx, self.helper = onnx, onnx.helper
        self.nodes: list[Any] = []
        self.initializers: list[Any] = []
        self.keys = {(id(n.leaf), n.attr): n.key for n in weight_names(model)}
        self.weights = weights
        self._count = 0

    def name(self, hint: str) -> str:
        self._count += 1
        return f"{hint}_{self._count}"

    def weight(self, leaf: Layer, attr: str) -> str:
        key = self.keys[(id(leaf), attr)]
        if not any(init.name == key for init in self.initializers):
            array = np.ascontiguousarray(self.weights[key], dtype=np.float32)
            self.initializers.append(self.onnx.numpy_helper.from_array(array, key))
        return key

    def constant(self, hint: str, values: list[int]) -> str:
        name = self.name(hint)
        array = np.asarray(values, dtype=np.int64)
        self.initializers.append(self.onnx.numpy_helper.from_array(array, name))
        return name

    def node(self, op: str, inputs: list[str], **attrs: Any) -> str:
        out = self.name(op.lower())
        self.nodes.append(self.helper.make_node(op, inputs, [out], name=out, **attrs))
        return out


def to_onnx(model: Model, weights: dict[str, np.ndarray]) -> Any:
    """The onnx.ModelProto of model, with weights = hpcdl.nn.weights_io.state_dict(model)."""
    onnx = optional_import("onnx", "export", "exporting to ONNX")
    helper = onnx.helper
    graph = _Graph(onnx, model, weights)
    out = _emit(graph, model.body, "input")
    c, h, w = model.input_shape
    tensor = onnx.TensorProto.FLOAT
    inputs = [helper.make_tensor_value_info("input", tensor, ["N", c, h, w])]
    graph.nodes.append(helper.make_node("Identity", [out], ["logits"], name="logits"))
    outputs = [helper.make_tensor_value_info("logits", tensor, ["N", model.num_classes])]
    proto = helper.make_model(
        helper.make_graph(graph.nodes, model.name, inputs, outputs, graph.initializers),
        opset_imports=[helper.make_opsetid("", OPSET)],
        producer_name="hpcdl",
    )
    proto.ir_version = IR_VERSION
    onnx.checker.check_model(proto)
    return proto


def _emit(graph: _Graph, layer: Layer, x: str) -> str:
    """Append layer's nodes that take tensor x; returns its output tensor's name."""
    for kind, emit in EMITTERS:
        if isinstance(layer, kind):
            return emit(graph, layer, x)
    raise ValueError(
        f"layer {type(layer).__name__} has no ONNX form; an exported model may use "
        f"{', '.join(kind.__name__ for kind, _ in EMITTERS)}"
    )


def _sequential(graph: _Graph, layer: Sequential, x: str) -> str:
    for child in layer.layers:
        x = _emit(graph, child, x)
    return x


def _residual(graph: _Graph, block: ResidualBlock, x: str) -> str:
    """relu(branch(x) + shortcut(x)); BottleneckBlock is a ResidualBlock too."""
    y = _emit(graph, block.branch, x)
    return graph.node("Relu", [graph.node("Add", [y, _emit(graph, block.shortcut, x)])])


def _option_a(graph: _Graph, layer: OptionAShortcut, x: str) -> str:
    """Subsample H and W by the stride, zero-pad the channels (He et al.'s option A)."""
    s, big = layer.stride, np.iinfo(np.int64).max
    starts, ends = graph.constant("starts", [0, 0]), graph.constant("ends", [big, big])
    axes, steps = graph.constant("axes", [2, 3]), graph.constant("steps", [s, s])
    y = graph.node("Slice", [x, starts, ends, axes, steps])
    if layer.c_in == layer.c_out:
        return y
    hi = layer.c_out - layer.c_in - layer.pad_lo
    return graph.node("Pad", [y, graph.constant("pads", [0, layer.pad_lo, 0, 0, 0, hi, 0, 0])])


def _conv(graph: _Graph, layer: Conv2d, x: str) -> str:
    inputs = [x, graph.weight(layer, "W")] + ([graph.weight(layer, "b")] if layer.has_bias else [])
    return graph.node(
        "Conv",
        inputs,
        kernel_shape=[layer.kh, layer.kw],
        strides=[layer.sh, layer.sw],
        pads=[layer.ph, layer.pw, layer.ph, layer.pw],
    )


def _batchnorm(graph: _Graph, layer: BatchNorm, x: str) -> str:
    names = ("gamma", "beta", "running_mean", "running_var")
    inputs = [x, *(graph.weight(layer, attr) for attr in names)]
    return graph.node("BatchNormalization", inputs, epsilon=layer.eps)


def _maxpool(graph: _Graph, layer: MaxPool2d, x: str) -> str:
    return graph.node(
        "MaxPool",
        [x],
        kernel_shape=[layer.kh, layer.kw],
        strides=[layer.sh, layer.sw],
        pads=[layer.ph, layer.pw, layer.ph, layer.pw],
    )


def _linear(graph: _Graph, layer: Linear, x: str) -> str:
    return graph.node("Gemm", [x, graph.weight(layer, "W"), graph.weight(layer, "b")], transB=1)


def _global_avg_pool(graph: _Graph, layer: GlobalAvgPool, x: str) -> str:
    return graph.node("Flatten", [graph.node("GlobalAveragePool", [x])], axis=1)


EMITTERS: list[tuple[type, Callable[[_Graph, Any, str], str]]] = [
    (ResidualBlock, _residual),
    (Sequential, _sequential),
    (OptionAShortcut, _option_a),
    (Conv2d, _conv),
    (BatchNorm, _batchnorm),
    (ReLU, lambda graph, layer, x: graph.node("Relu", [x])),
    (MaxPool2d, _maxpool),
    (Linear, _linear),
    (GlobalAvgPool, _global_avg_pool),
    (Flatten, lambda graph, layer, x: graph.node("Flatten", [x], axis=1)),
    (Dropout, lambda graph, layer, x: x),
]
