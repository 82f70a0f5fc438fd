"""hpcdl's optimizer flags mapped onto torch.optim, over a FlatModule, with its state as flat
vectors for hpcdl's checkpoints (NOTE [a module in flat vectors])."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from hpcdl.config import TrainConfig
from hpcdl.torch_engine.flat import FlatModule

# Adam(W)'s constants are hpcdl.nn.optim's: betas (0.9, 0.999), eps 1e-8.
BETAS, EPS = (0.9, 0.999), 1e-8


class FlatOptimizer:
    """torch.optim's SGD (momentum, nesterov), Adam or AdamW for --optimizer, --momentum,
    --nesterov, --weight-decay and --no-decay-bias-norm (biases and norms: the 1-d
    parameters); the learning rate of every step is the run's (hpcdl.nn.schedule)."""

    def __init__(self, cfg: TrainConfig, model: FlatModule) -> None:
        self.model = model
        tensors = model.tensors
        wd = cfg.weight_decay
        kept = [p for p in tensors if p.requires_grad]
        if cfg.decay_bias_norm:
            groups = [{"params": kept, "weight_decay": wd}]
        else:
            groups = [
                {"params": [p for p in kept if p.dim() > 1], "weight_decay": wd},
                {"params": [p for p in kept if p.dim() <= 1], "weight_decay": 0.0},
            ]
        groups = [g for g in groups if g["params"]]
        if cfg.optimizer == "sgd":
            self.optimizer = torch.optim.SGD(
                groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov
            )
            self.keys = ["momentum_buffer"] if cfg.momentum else []
        else:
            cls = torch.optim.AdamW if cfg.optimizer == "adamw" else torch.optim.Adam
            self.optimizer = cls(groups, lr=cfg.lr, betas=BETAS, eps=EPS)
            self.keys = ["exp_avg", "exp_avg_sq"]
        self.adam = cfg.optimizer != "sgd"
        self.updates = 0  # optimizer steps taken (Adam's step count)

    def step(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.updates += 1

    def state_dict(self) -> dict[str, np.ndarray]:
        """{state name: (P,) float32 in the parameters' order, "updates": (1,) float64}."""
        out = {"updates": np.array([self.updates], np.float64)}
        for key in self.keys:
            flat = np.zeros(self.model.params.size, np.float32)
            for p, lo, hi in self._slices():
                value = self.optimizer.state.get(p, {}).get(key)
                if value is not None:
                    flat[lo:hi] = value.detach().reshape(-1).cpu().numpy()  # a CPU copy
            out[key] = flat
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The state a state_dict() of this optimizer returned; ValueError if it is not."""
        size = self.model.params.size
        for key in self.keys:
            if np.shape(state[key]) != (size,):
                raise ValueError(f"optimizer state {key} has shape {np.shape(state[key])}, "
                                 f"not ({size},)")  # fmt: skip
        updates = np.asarray(state["updates"]).reshape(-1)
        if updates.size != 1 or not updates[0] >= 0:
            raise ValueError(f"optimizer state 'updates' is {updates!r}, not one count")
        self.updates = int(updates[0])
        self.optimizer.state.clear()
        if not self.updates:
            return
        for p, lo, hi in self._slices():
            slot = self.optimizer.state[p]
            for key in self.keys:
                slot[key] = torch.from_numpy(np.array(state[key][lo:hi])).view(p.shape).to(p.device)
            if self.adam:
                slot["step"] = torch.tensor(float(self.updates), dtype=torch.float32)

    def _slices(self) -> list[tuple[Any, int, int]]:
        offsets = self.model.offsets
        return [
            (p, lo, hi)
            for p, lo, hi in zip(self.model.tensors, offsets, offsets[1:])
            if p.requires_grad
        ]
