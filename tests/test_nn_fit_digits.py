"""Real data: scikit-learn's digits (1797 8x8 images), 20% held out with a seeded split."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from hpcdl import nn

sklearn = pytest.importorskip("sklearn")


@functools.lru_cache(maxsize=1)
def digits():
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    x = (data.images / 16.0).astype(np.float32)[:, None, :, :]  # (1797, 1, 8, 8) in [0, 1]
    x = (x - x.mean()) / x.std()
    y = data.target.astype(np.int64)
    return train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)


@pytest.mark.parametrize(
    "name,optimizer,epochs,batch,lr",
    [("mlp", "sgd", 15, 32, 0.05), ("cnn", "sgd", 20, 32, 0.02), ("cnn", "adam", 10, 32, 1e-3)],
)
def test_model_learns_digits_to_95_percent_held_out(name, optimizer, epochs, batch, lr):
    x_train, x_test, y_train, y_test = digits()
    model = nn.build_model(name, (1, 8, 8), 10, seed=0)
    opt = nn.make_optimizer(optimizer, model.params, model.grads, momentum=0.9)
    steps = len(x_train) // batch
    schedule = nn.schedule.LrSchedule(
        base_lr=lr, steps_per_epoch=steps, warmup_epochs=1, decay="cosine", total_epochs=epochs
    )
    history = nn.fit(
        model, x_train, y_train, epochs, batch, opt, lr=schedule, seed=0, x_val=x_test, y_val=y_test
    )
    assert history["loss"][-1] < history["loss"][0]
    assert history["val_acc"][-1] >= 0.95, history["val_acc"]
    _, acc = nn.evaluate(model, x_test, y_test)
    assert acc == history["val_acc"][-1]
