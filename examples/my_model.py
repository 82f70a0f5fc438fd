"""A model of your own for hpcdl: a VGG-style convnet with BatchNorm, from hpcdl.nn layers.

Four stages of two 3x3 convolution-BatchNorm-ReLU layers (32, 64, 128, 256 channels), each
stage but the last followed by a 2x2 max pool while the image is at least 2x2; then global
average pooling, dropout and a dense classifier. It takes any input size: 3x224x224 crops
leave the last stage at 28x28, 3x32x32 at 4x4, the 1x8x8 digits at 1x1.

    python -m hpcdl.data convert digits digits
    python -m hpcdl.nn summary examples/my_model.py:build --input-shape 1,8,8 --num-classes 10
    mpirun -np 2 python -m hpcdl.train --data digits/train --val-data digits/val \\
        --model examples/my_model.py:build --epochs 8 --batch-size 32 --lr 0.02

hpcdl calls `build(input_shape, num_classes)` on every rank, input_shape being the (C, H, W)
the loader yields (after --augment), and initialises the parameters of the layers it returns
from --seed, exactly as it does for its built-in models. See docs/models.md
(validation accuracy 0.98-0.99 on digits with the command above).
"""

from __future__ import annotations

from hpcdl import nn

WIDTHS = (32, 64, 128, 256)


def conv_bn_relu(c_in: int, c_out: int) -> list[nn.Layer]:
    """3x3 'same' convolution without bias (BatchNorm has one), BatchNorm, ReLU."""
    return [nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm(c_out), nn.ReLU()]


def build(input_shape: tuple[int, int, int], num_classes: int) -> list[nn.Layer]:
    """The layers of the network for (C, H, W) inputs and num_classes outputs."""
    c, h, w = input_shape
    layers: list[nn.Layer] = []
    for stage, width in enumerate(WIDTHS):
        layers += conv_bn_relu(c, width) + conv_bn_relu(width, width)
        c = width
        if stage < len(WIDTHS) - 1 and h >= 2 and w >= 2:
            layers.append(nn.MaxPool2d(2))
            h, w = h // 2, w // 2
    return layers + [nn.GlobalAvgPool(), nn.Dropout(0.2), nn.Linear(c, num_classes)]
