"""Optimizers that update the whole flat parameter buffer in one vectorised pass.

They hold views of `model.params` and `model.grads` and never loop over layers. Weight decay:
SGD and Adam add L2 to the gradient (g + wd*p, PyTorch's `weight_decay`); AdamW decouples it
(p *= 1 - lr*wd, then the Adam step). It applies to every parameter unless a `decay_mask` (P,)
of 0/1 is given (`Model.decay_mask()`: 0 for biases and BatchNorm).
"""

from __future__ import annotations

from typing import Any

from hpcdl.backend import array_module
from hpcdl.nn.kernels import Seam

OPTIMIZERS = ("sgd", "adam", "adamw")


class SGD:
    """SGD with momentum, PyTorch form: v = m*v + g; p -= lr * v (Nesterov: lr * (g + m*v))."""

    masks_update = True  # step takes the device "apply" flag (NOTE [device loss scale])

    def __init__(
        self, params, grads, momentum=0.0, nesterov=False, weight_decay=0.0, decay_mask=None
    ):
        if nesterov and momentum <= 0:
            raise ValueError("Nesterov momentum needs momentum > 0")
        self.params, self.grads = params, grads
        self.momentum, self.nesterov, self.weight_decay = momentum, nesterov, weight_decay
        self.decay_mask = decay_mask  # (P,) 0/1 or None (decay everything)
        xp = array_module(params)
        self.velocity = xp.zeros_like(params)  # (P,) same layout as params
        self._scratch = xp.empty_like(params)
        self._velocity_next: Any = None  # made on the first masked step (apply given)
        self.seam = Seam("optimizer")  # a fused update comes first (hpcdl.nn.kernels)

    def step(self, lr: Any, apply: Any = None) -> None:
        """One update with learning rate lr (a float, or a 0-d device scalar). apply: None, or
        a 0-d bool on the params' backend: False leaves params and velocity as they were,
        decided on the device (fp16's skipped step), with the same bits as the plain update
        when True."""
        if self.seam.take(self, self.params):
            return self.seam.kernel.step(self, lr, apply)
        d = self._scratch
        if self.weight_decay:
            _decay_term(self.params, self.weight_decay, self.decay_mask, out=d)
            d += self.grads
        else:
            d[...] = self.grads
        if self.momentum:
            v = self.velocity if apply is None else self._next_velocity()
            v *= self.momentum
            v += d
            if self.nesterov:
                d += self.momentum * v
            else:
                d[...] = v
            if apply is not None:
                array_module(v).copyto(self.velocity, v, where=apply)
        d *= -lr
        if apply is None:
            self.params += d
        else:
            d += self.params  # params + d, the bits of `params += d`
            array_module(d).copyto(self.params, d, where=apply)

    def _next_velocity(self) -> Any:
        """A copy of the velocity to update, kept only where the step applies."""
        if self._velocity_next is None:
            self._velocity_next = array_module(self.params).empty_like(self.params)
        self._velocity_next[...] = self.velocity
        return self._velocity_next

    def state_dict(self) -> dict[str, Any]:
        return {"velocity": self.velocity.copy()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _load(self.velocity, state, "velocity")


class Adam:
    """Adam (Kingma & Ba) with bias correction; weight decay is L2 added to the gradient."""

    decoupled = False  # AdamW: decay the parameters directly instead
    masks_update = True  # step takes the device "apply" flag (NOTE [device loss scale])

    def __init__(
        self, params, grads, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, decay_mask=None
    ):
        self.params, self.grads = params, grads
        self.beta1, self.beta2 = betas
        self.eps, self.weight_decay = eps, weight_decay
        self.decay_mask = decay_mask  # (P,) 0/1 or None (decay everything)
        xp = array_module(params)
        self.m = xp.zeros_like(params)  # (P,) first moment
        self.v = xp.zeros_like(params)  # (P,) second moment
        self._t = 0  # steps taken (host); with a masked step, _t_device counts them
        self._t_device: Any = None
        self._scratch = xp.empty_like(params)
        self._next: Any = None  # (params, m, v) updated, kept where the step applies
        self.seam = Seam("optimizer")  # a fused update comes first (hpcdl.nn.kernels)

    @property
    def t(self) -> int:
        """Steps taken (with the device count: a host read of it)."""
        return self._t if self._t_device is None else int(self._t_device)

    @t.setter
    def t(self, value: int) -> None:
        self._t = value
        if self._t_device is not None:
            self._t_device[...] = value

    def count_on_device(self) -> Any:
        """The step count as a 0-d int64 on the params' backend, made from the host's count
        once; from then on it is the count (`t` reads it), advanced on the device."""
        if self._t_device is None:
            xp = array_module(self.params)
            self._t_device = xp.asarray(self._t, dtype=xp.int64)
        return self._t_device

    def step(self, lr: float, apply: Any = None) -> None:
        """One update. apply: None, or a 0-d bool on the params' backend: False leaves params,
        moments and the step count as they were, decided on the device (fp16's skipped step),
        with the same bits as the plain update when True."""
        if self.seam.take(self, self.params):
            return self.seam.kernel.step(self, lr, apply)
        if apply is not None:
            return self._masked_step(lr, apply)
        xp = array_module(self.params)
        self.t += 1
        g = self.grads
        if self.weight_decay and self.decoupled:  # torch.optim.AdamW: p *= 1 - lr*wd first
            if self.decay_mask is None:
                self.params *= 1.0 - lr * self.weight_decay
            else:
                self.params -= _decay_term(
                    self.params, lr * self.weight_decay, self.decay_mask, out=self._scratch
                )
        elif self.weight_decay:
            g = _decay_term(self.params, self.weight_decay, self.decay_mask, out=self._scratch)
            g += self.grads
        self.m *= self.beta1
        self.m += (1.0 - self.beta1) * g
        self.v *= self.beta2
        self.v += (1.0 - self.beta2) * (g * g)
        # PyTorch form: p -= lr * m_hat / (sqrt(v_hat) + eps), bias corrections folded in.
        d = xp.multiply(self.v, 1.0 / (1.0 - self.beta2**self.t), out=self._scratch)
        xp.sqrt(d, out=d)
        d += self.eps
        xp.divide(self.m, d, out=d)
        d *= -lr / (1.0 - self.beta1**self.t)
        self.params += d

    def _masked_step(self, lr: float, apply: Any) -> None:
        """step's arithmetic on copies of params, m and v, kept where `apply`; the step count
        and the bias corrections on the device (float64, rounded to float32 once, as the host's
        Python floats are)."""
        xp = array_module(self.params)
        if self._next is None:
            self._next = tuple(xp.empty_like(self.params) for _ in range(3))
        t = (self.count_on_device() + 1).astype(xp.float64)
        params, m, v = self._next
        params[...], m[...], v[...] = self.params, self.m, self.v
        g = self.grads
        if self.weight_decay and self.decoupled:
            if self.decay_mask is None:
                params *= 1.0 - lr * self.weight_decay
            else:
                params -= _decay_term(
                    params, lr * self.weight_decay, self.decay_mask, self._scratch
                )
        elif self.weight_decay:
            g = _decay_term(params, self.weight_decay, self.decay_mask, out=self._scratch)
            g += self.grads
        m *= self.beta1
        m += (1.0 - self.beta1) * g
        v *= self.beta2
        v += (1.0 - self.beta2) * (g * g)
        correction = (1.0 / (1.0 - self.beta2**t)).astype(xp.float32)
        d = xp.multiply(v, correction, out=self._scratch)
        xp.sqrt(d, out=d)
        d += self.eps
        xp.divide(m, d, out=d)
        d *= (-lr / (1.0 - self.beta1**t)).astype(xp.float32)
        params += d
        for target, value in zip((self.params, self.m, self.v), self._next, strict=True):
            xp.copyto(target, value, where=apply)
        self._t_device += apply

    def state_dict(self) -> dict[str, Any]:
        xp = array_module(self.params)
        return {"m": self.m.copy(), "v": self.v.copy(), "t": xp.asarray(self.t)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _load(self.m, state, "m")
        _load(self.v, state, "v")
        self.t = int(state["t"])


class AdamW(Adam):
    """Adam with decoupled weight decay (Loshchilov & Hutter), as torch.optim.AdamW.

    p *= 1 - lr*wd, then the Adam step on the plain gradient. Same state as Adam."""

    decoupled = True


def make_optimizer(
    name: str,
    params: Any,
    grads: Any,
    momentum: float = 0.9,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    decay_mask: Any = None,
) -> SGD | Adam:
    """'sgd', 'adam' or 'adamw' over the flat buffers.

    Adam(W) ignores momentum/nesterov (betas 0.9, 0.999, eps 1e-8). decay_mask: (P,) 0/1 on the
    params' backend (Model.decay_mask()) to keep biases and BatchNorm out of weight decay."""
    if name == "sgd":
        return SGD(params, grads, momentum, nesterov, weight_decay, decay_mask)
    if name in ("adam", "adamw"):
        cls = AdamW if name == "adamw" else Adam
        return cls(params, grads, weight_decay=weight_decay, decay_mask=decay_mask)
    raise ValueError(f"unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}")


def _decay_term(params: Any, scale: float, mask: Any, out: Any) -> Any:
    """out = scale * params (* mask): the weight-decay term, (P,)."""
    xp = array_module(params)
    xp.multiply(params, scale, out=out)
    if mask is not None:
        out *= mask
    return out


def _load(target: Any, state: dict[str, Any], key: str) -> None:
    if key not in state:
        raise ValueError(f"optimizer state has no {key!r}; it was saved by another optimizer")
    value = state[key]
    if tuple(value.shape) != tuple(target.shape):
        raise ValueError(
            f"optimizer state {key!r} has shape {tuple(value.shape)}, expected {target.shape}"
        )
    xp = array_module(target)
    target[...] = xp.asarray(value)
