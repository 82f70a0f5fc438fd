"""hpcdl.nn: NumPy/CuPy layers, models on flat buffers, losses, optimizers and schedules.

No MPI and no data loading here; the contracts are in docs/internals.md, the details in
docs/nn.md.
"""

from hpcdl.nn import kernels, precision, schedule
from hpcdl.nn.blocks import BottleneckBlock, ResidualBlock, Sequential
from hpcdl.nn.conv import Conv2d
from hpcdl.nn.fit import NonFiniteLossError, evaluate, fit
from hpcdl.nn.layers import (
    Dropout,
    Flatten,
    GlobalAvgPool,
    Layer,
    Linear,
    MaxPool2d,
    ReLU,
)
from hpcdl.nn.loss import accuracy_count, softmax_cross_entropy
from hpcdl.nn.model import Model, rank_rng_state
from hpcdl.nn.models import MODELS, build_model
from hpcdl.nn.norm import BatchNorm
from hpcdl.nn.optim import OPTIMIZERS, SGD, Adam, AdamW, make_optimizer

__all__ = [
    "MODELS",
    "OPTIMIZERS",
    "SGD",
    "Adam",
    "AdamW",
    "BatchNorm",
    "BottleneckBlock",
    "Conv2d",
    "Dropout",
    "Flatten",
    "GlobalAvgPool",
    "Layer",
    "Linear",
    "MaxPool2d",
    "Model",
    "NonFiniteLossError",
    "ReLU",
    "ResidualBlock",
    "Sequential",
    "accuracy_count",
    "build_model",
    "evaluate",
    "fit",
    "kernels",
    "make_optimizer",
    "precision",
    "rank_rng_state",
    "schedule",
    "softmax_cross_entropy",
]
