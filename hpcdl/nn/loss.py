"""Softmax cross-entropy (mean over the batch) and top-1 accuracy."""

from __future__ import annotations

from typing import Any

from hpcdl.backend import array_module


def softmax_cross_entropy(logits: Any, labels: Any) -> tuple[Any, Any]:
    """logits (N, K) float, labels (N,) int -> (mean loss as a 0-d array, dlogits (N, K)).

    Stable log-sum-exp: the row maximum is subtracted before exponentiating.
    """
    xp = array_module(logits)
    if logits.ndim != 2 or labels.shape != (logits.shape[0],):
        raise ValueError(
            f"softmax_cross_entropy needs logits (N, K) and labels (N,), "
            f"got {tuple(logits.shape)} and {tuple(labels.shape)}"
        )
    n = logits.shape[0]
    shifted = logits - logits.max(axis=1, keepdims=True)
    exp = xp.exp(shifted)
    sum_exp = exp.sum(axis=1, keepdims=True)
    rows = xp.arange(n)
    log_prob_true = shifted[rows, labels] - xp.log(sum_exp[:, 0])
    loss = -log_prob_true.mean()
    dlogits = exp
    dlogits /= sum_exp
    dlogits[rows, labels] -= 1.0
    dlogits /= n
    return loss, dlogits


def accuracy_count(logits: Any, labels: Any) -> Any:
    """Number of rows whose arg-max equals the label: an integer scalar on the logits' backend,
    left there (no host sync; int() reads it)."""
    return (logits.argmax(axis=1) == labels).sum()
