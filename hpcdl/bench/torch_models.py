"""torchvision's ImageNet ResNet-18 and ResNet-50, written out in PyTorch for `bench compute`
and for the tests of hpcdl's weights import and export (hpcdl.nn.weight_names).

The PyPI torchvision wheels are built against CUDA PyTorch; with the CPU-only torch wheel they
fail to import ("operator torchvision::nms does not exist"), so neither can rely on them. This
is torchvision 0.2x's `resnet18`/`resnet50` (`torchvision/models/resnet.py`) module for module,
with its attribute names, so its state_dict keys are torchvision's (conv1, bn1,
layer1.0.conv1, ..., layer2.0.downsample.0, fc): 7x7 stride-2 stem without bias, BatchNorm,
ReLU, 3x3 stride-2 max pool; four stages of basic blocks (two 3x3 convolutions) or bottleneck
blocks (1x1, 3x3 carrying the stride as in "ResNet v1.5", 1x1 to 4 x width); a 1x1
convolution + BatchNorm `downsample` where the shape changes; adaptive average pool; a dense
classifier. Convolutions are Kaiming-normal (fan_out), BatchNorm starts at 1 and 0, as
torchvision initialises them. `resnet18` and `resnet50` are builders for `hpcdl.train --model
hpcdl.bench.torch_models:resnet18` (the torch engine) and for the benchmarks' torch peers. With
1000 classes the parameter counts are torchvision's:
11,689,512 and 25,557,032. Needs `torch` (the `bench` extra); hpcdl never imports this module.
"""

from __future__ import annotations

import torch
from torch import nn

DEPTHS = {"resnet18": (2, 2, 2, 2), "resnet50": (3, 4, 6, 3)}


def _conv(c_in: int, c_out: int, kernel: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(c_in, c_out, kernel, stride, padding=kernel // 2, bias=False)


def _downsample(c_in: int, c_out: int, stride: int) -> nn.Module | None:
    """torchvision's `downsample`: 1x1 convolution + BatchNorm when the shape changes."""
    if stride == 1 and c_in == c_out:
        return None
    return nn.Sequential(_conv(c_in, c_out, 1, stride), nn.BatchNorm2d(c_out))


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, c_in: int, width: int, stride: int) -> None:
        super().__init__()
        self.conv1 = _conv(c_in, width, 3, stride)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = _conv(width, width, 3)
        self.bn2 = nn.BatchNorm2d(width)
        self.downsample = _downsample(c_in, width, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x)))))
        return self.relu(y + (x if self.downsample is None else self.downsample(x)))


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, c_in: int, width: int, stride: int) -> None:
        super().__init__()
        c_out = width * self.expansion
        self.conv1 = _conv(c_in, width, 1)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = _conv(width, width, 3, stride)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = _conv(width, c_out, 1)
        self.bn3 = nn.BatchNorm2d(c_out)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = _downsample(c_in, c_out, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return self.relu(y + (x if self.downsample is None else self.downsample(x)))


class ResNet(nn.Module):
    """torchvision.models.ResNet: input (N, in_channels, H, W), logits (N, num_classes)."""

    def __init__(self, name: str, in_channels: int = 3, num_classes: int = 1000) -> None:
        super().__init__()
        if name not in DEPTHS:
            raise ValueError(f"unknown ResNet {name!r}; choose one of {', '.join(DEPTHS)}")
        block = Bottleneck if name == "resnet50" else BasicBlock
        self.conv1 = _conv(in_channels, 64, 7, 2)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, padding=1)
        c_in = 64
        for stage, (width, depth) in enumerate(zip((64, 128, 256, 512), DEPTHS[name])):
            blocks = []
            for i in range(depth):
                blocks.append(block(c_in, width, 2 if stage > 0 and i == 0 else 1))
                c_in = width * block.expansion
            setattr(self, f"layer{stage + 1}", nn.Sequential(*blocks))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c_in, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def imagenet_resnet(name: str, in_channels: int = 3, num_classes: int = 1000) -> ResNet:
    """torchvision's resnet18 or resnet50, initialised as torchvision initialises it."""
    model = ResNet(name, in_channels, num_classes)
    for module in model.modules():
        if isinstance(module, nn.Conv2d):
            nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(module, nn.BatchNorm2d):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
    return model


def resnet18(input_shape: tuple[int, int, int], num_classes: int) -> ResNet:
    """`--model hpcdl.bench.torch_models:resnet18`: torchvision's resnet18 for the input's
    channels and num_classes (tools.bench train --torch-engine, both sides)."""
    return imagenet_resnet("resnet18", input_shape[0], num_classes)


def resnet50(input_shape: tuple[int, int, int], num_classes: int) -> ResNet:
    """`--model hpcdl.bench.torch_models:resnet50`: torchvision's resnet50, likewise."""
    return imagenet_resnet("resnet50", input_shape[0], num_classes)
