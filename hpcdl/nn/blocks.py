"""Containers: a sequence of layers and the ResNet blocks (basic and bottleneck, residual add)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from hpcdl.backend import array_module
from hpcdl.nn import kernels
from hpcdl.nn.conv import Conv2d
from hpcdl.nn.layers import Layer, ReLU
from hpcdl.nn.norm import BatchNorm
from hpcdl.nn.threads import run_split


class Sequential(Layer):
    """Layers applied in order. A ReLU right after a layer with a fresh output works in place.

    `rounding` (set by Model.set_precision): rounds each layer's output and input gradient in
    place to the reduced precision, unless the layer keeps its input's precision."""

    def __init__(self, layers: list[Layer]) -> None:
        super().__init__()
        self.layers = list(layers)
        self.rounding: Callable[[Any], None] | None = None
        self.fused: set[int] = set()  # ReLUs fused into their BatchNorm by the last forward
        for prev, layer in zip(self.layers, self.layers[1:]):
            if isinstance(layer, ReLU) and prev.fresh_output:
                layer.inplace = True

    @property
    def fresh_output(self) -> bool:
        return bool(self.layers) and self.layers[-1].fresh_output

    def leaves(self) -> Iterator[Layer]:
        for layer in reversed(self.layers):
            yield from layer.leaves()

    def named_children(self) -> list[tuple[str, Layer]]:
        return [(str(i), layer) for i, layer in enumerate(self.layers)]

    def forward(self, x, train=True):
        return self.forward_to(len(self.layers), x, train)

    def forward_to(self, end: int, x: Any, train: bool = True) -> Any:
        """Forward through layers[:end]. With the fast kernels (hpcdl.nn.kernels), a BatchNorm
        followed by a ReLU asks for the two fused (BatchNorm.forward_relu); the ReLU is then
        skipped, here and in backward."""
        self.fused = set()  # indices of the ReLUs fused into their BatchNorm this forward
        for i, layer in enumerate(self.layers[:end]):
            if i in self.fused:
                continue
            y = self._fused_pair(i, x, train, end) if kernels.enabled() else None
            x = layer.forward(x, train) if y is None else y
            if self.rounding is not None and not layer.keeps_precision:
                self.rounding(x)
        return x

    def _fused_pair(self, i: int, x: Any, train: bool, end: int) -> Any:
        """relu(bn(x)) for layers[i:i+2] = BatchNorm, ReLU in one kernel, or None."""
        layer = self.layers[i]
        if i + 1 >= end or not isinstance(layer, BatchNorm):
            return None
        if not isinstance(self.layers[i + 1], ReLU):
            return None
        y = layer.forward_relu(x, train)
        if y is not None:
            self.fused.add(i + 1)
        return y

    def backward(self, dy, ready=None):
        return self.backward_from(0, dy, ready)

    def backward_from(self, first: int, dy: Any, ready=None, end: int | None = None) -> Any:
        """Backward through layers[first:end] only (the model skips what precedes its first
        parameterised layer); the input gradient of layers[first]."""
        end = len(self.layers) if end is None else end
        for i in reversed(range(first, end)):
            if i in self.fused:  # its BatchNorm's fused backward applies the ReLU's mask
                continue
            layer = self.layers[i]
            dy = layer.backward(dy, ready)
            if self.rounding is not None and not layer.keeps_precision and dy is not None:
                self.rounding(dy)
        return dy


class OptionAShortcut(Layer):
    """Parameter-free shortcut (He et al. 2016, CIFAR option A).

    Subsamples (N, H, W, C_in) with the block's stride and zero-pads the channels to C_out.
    """

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.c_in, self.c_out, self.stride = c_in, c_out, stride
        self.pad_lo = (c_out - c_in) // 2

    def forward(self, x, train=True):
        xp = array_module(x)
        s = self.stride
        sub = x[:, ::s, ::s, :]
        self.x_shape = x.shape
        if self.c_in == self.c_out:
            return sub
        y = xp.zeros((*sub.shape[:3], self.c_out), dtype=x.dtype)
        y[..., self.pad_lo : self.pad_lo + self.c_in] = sub
        return y

    def backward(self, dy, ready=None):
        xp = array_module(dy)
        s = self.stride
        if s == 1 and self.c_in == self.c_out:
            return dy
        dx = xp.zeros(self.x_shape, dtype=dy.dtype)
        dx[:, ::s, ::s, :] = dy[..., self.pad_lo : self.pad_lo + self.c_in]
        return dx


def conv_bn(c_in: int, c_out: int, stride: int, kernel: int = 3) -> list[Layer]:
    """Convolution without bias followed by BatchNorm (the bias would be cancelled by BN).

    Initialised as torchvision's ResNets: Kaiming-normal fan_out kernel, BatchNorm 1 and 0."""
    conv = Conv2d(
        c_in, c_out, kernel, stride, padding=kernel // 2, bias=False, init="kaiming_normal_fan_out"
    )
    return [conv, BatchNorm(c_out)]


class ResidualBlock(Layer):
    """ResNet basic block: relu(bn(conv(relu(bn(conv(x))))) + shortcut(x)).

    shortcut "A": parameter-free subsample + zero channel padding (used by resnet20);
    "B": 1x1 convolution + BatchNorm when the shape changes. Identity when it does not.
    Backward finishes the residual branch's layers first, then the shortcut's, and the
    layout follows that order.
    """

    def __init__(self, c_in: int, c_out: int, stride: int = 1, shortcut: str = "A") -> None:
        super().__init__()
        self.branch = Sequential([*conv_bn(c_in, c_out, stride), ReLU(), *conv_bn(c_out, c_out, 1)])
        self.shortcut = _shortcut(c_in, c_out, stride, shortcut)
        self.relu = ReLU(inplace=True)  # on branch + shortcut, a sum this block owns

    def leaves(self) -> Iterator[Layer]:
        yield from self.relu.leaves()
        yield from self.branch.leaves()
        yield from self.shortcut.leaves()

    def named_children(self) -> list[tuple[str, Layer]]:
        return [("branch", self.branch), ("shortcut", self.shortcut)]

    def forward(self, x, train=True):
        self.fused = False
        if kernels.enabled() and train and isinstance(self.branch.layers[-1], BatchNorm):
            z = self._fused_forward(x, train)
            if z is not None:
                return z
        y = self.branch.forward(x, train)  # a fresh array: BatchNorm's output
        return self.relu.forward(y, train, residual=self.shortcut.forward(x, train))

    def _fused_forward(self, x: Any, train: bool) -> Any:
        """relu(bn(h) + shortcut(x)) with the branch's last BatchNorm, the add and the ReLU in
        one kernel (BatchNorm.forward_relu), or None: then the reference ran no part of it."""
        last = len(self.branch.layers) - 1
        h = self.branch.forward_to(last, x, train)
        residual = self.shortcut.forward(x, train)
        z = self.branch.layers[last].forward_relu(h, train, residual=residual)
        if z is None:  # the branch's last layer and the ReLU, unfused
            y = self.branch.layers[last].forward(h, train)
            if self.branch.rounding is not None:
                self.branch.rounding(y)
            return self.relu.forward(y, train, residual=residual)
        self.fused = True
        return z

    def backward(self, dy, ready=None):
        if getattr(self, "fused", False):  # the ReLU and the add are the BatchNorm's
            bn = self.branch.layers[-1]
            dy_bn = bn.backward(dy, ready)
            dy = bn.residual_grad
            if self.branch.rounding is not None:  # emulated: as Sequential rounds them
                for grad in (dy_bn, dy):
                    self.branch.rounding(grad)
            dx = self.branch.backward_from(0, dy_bn, ready, end=len(self.branch.layers) - 1)
        else:
            dy = self.relu.backward(dy, ready)
            dx = self.branch.backward(dy, ready)  # a fresh array: a convolution's input grad
        shortcut_dx = self.shortcut.backward(dy, ready)

        def add(first: int, count: int, part: int) -> None:
            dx[first : first + count] += shortcut_dx[first : first + count]

        run_split(len(dx), add, dx)
        return dx


class BottleneckBlock(ResidualBlock):
    """ResNet-50's block: 1x1 conv to `width`, 3x3 conv (carrying the stride, torchvision's
    "ResNet v1.5"), 1x1 conv to 4 * width, each followed by BatchNorm; relu(branch + shortcut).

    The shortcut is a 1x1 convolution + BatchNorm when the shape changes (option B), else the
    identity."""

    expansion = 4

    def __init__(self, c_in: int, width: int, stride: int = 1) -> None:
        Layer.__init__(self)
        c_out = width * self.expansion
        self.branch = Sequential(
            [
                *conv_bn(c_in, width, 1, kernel=1),
                ReLU(),
                *conv_bn(width, width, stride),
                ReLU(),
                *conv_bn(width, c_out, 1, kernel=1),
            ]
        )
        self.shortcut = _shortcut(c_in, c_out, stride, "B")
        self.relu = ReLU(inplace=True)


def _shortcut(c_in: int, c_out: int, stride: int, kind: str) -> Layer:
    """Identity when the shape is kept; else option A (subsample + zero channels) or B (1x1
    convolution + BatchNorm)."""
    if c_in == c_out and stride == 1:
        return Sequential([])
    if kind == "A":
        return OptionAShortcut(c_in, c_out, stride)
    if kind == "B":
        return Sequential(conv_bn(c_in, c_out, stride, kernel=1))
    raise ValueError(f"ResidualBlock shortcut must be 'A' or 'B', got {kind!r}")
