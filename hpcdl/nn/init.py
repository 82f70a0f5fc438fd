"""Parameter initialisers by name, each the formula of the framework it is named after.

A layer names its initialisers in its `ParamSpec`s (`Linear(..., init=, bias_init=)`); the model
draws every value on the host in float64 from one seeded NumPy generator, in forward order, so
the values depend on neither the flat layout nor the backend. fan_in/fan_out are those of the
layer the parameter belongs to (kh*kw*C_in and kh*kw*C_out for a convolution), also for a bias.

- `zeros`, `ones`: constants (biases, BatchNorm shift and scale).
- `glorot_uniform`: U(-a, a), a = sqrt(6 / (fan_in + fan_out)); the Keras default kernel.
- `he_normal`: N(0, 2 / fan_in); torch `kaiming_normal_(mode="fan_in", nonlinearity="relu")`.
- `kaiming_normal_fan_out`: N(0, 2 / fan_out); torchvision's ResNet convolutions.
- `torch_default`: U(-a, a), a = 1 / sqrt(fan_in); PyTorch's nn.Linear / nn.Conv2d default for
  the weight (`kaiming_uniform_(a=sqrt(5))`) and the bias alike.

`he_normal` is PyTorch's untruncated form; Keras's `he_normal` truncates at two standard
deviations.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np


def _uniform(rng: np.random.Generator, shape: tuple[int, ...], limit: float) -> np.ndarray:
    return rng.uniform(-limit, limit, shape)


def _normal(rng: np.random.Generator, shape: tuple[int, ...], std: float) -> np.ndarray:
    return rng.standard_normal(shape) * std


INITIALISERS: dict[str, Callable[[np.random.Generator, Any], np.ndarray]] = {
    "zeros": lambda rng, s: np.zeros(s.shape),
    "ones": lambda rng, s: np.ones(s.shape),
    "glorot_uniform": lambda rng, s: _uniform(rng, s.shape, np.sqrt(6.0 / (s.fan_in + s.fan_out))),
    "he_normal": lambda rng, s: _normal(rng, s.shape, np.sqrt(2.0 / s.fan_in)),
    "kaiming_normal_fan_out": lambda rng, s: _normal(rng, s.shape, np.sqrt(2.0 / s.fan_out)),
    "torch_default": lambda rng, s: _uniform(rng, s.shape, 1.0 / np.sqrt(s.fan_in)),
}


def check_initialiser(name: str) -> None:
    """Raise ValueError naming the allowed initialisers unless `name` is one of them."""
    if name not in INITIALISERS:
        raise ValueError(
            f"unknown initialiser {name!r}; choose one of {', '.join(sorted(INITIALISERS))}"
        )


def initial_values(rng: np.random.Generator, spec: Any) -> np.ndarray:
    """Host float64 values of shape spec.shape for a ParamSpec, drawn from rng."""
    check_initialiser(spec.init)
    return INITIALISERS[spec.init](rng, spec)
