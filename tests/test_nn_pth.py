"""hpcdl.nn.pth: PyTorch's .pth zip format read and written without PyTorch, checked against
PyTorch itself (torch.save / torch.load(weights_only=True))."""

from __future__ import annotations

import zipfile

import numpy as np
import pytest

from hpcdl.nn.pth import PthError, read_pth, write_pth

torch = pytest.importorskip("torch")


def test_what_torch_saves_is_read_with_views_dtypes_and_shared_storage(tmp_path):
    base = torch.arange(12.0).reshape(3, 4)
    state = {
        "transposed": base.t(),  # a view: strides (1, 4) into the same storage
        "row": base[1],  # offset 4 into the same storage
        "half": torch.tensor([0.5, -1.0], dtype=torch.float16),
        "bf16": torch.tensor([1.5, -2.0, 3.0], dtype=torch.bfloat16),
        "count": torch.tensor(7),  # 0-d int64, as num_batches_tracked
    }
    torch.save(state, tmp_path / "t.pth")
    got = read_pth(tmp_path / "t.pth")
    assert list(got) == list(state)
    for key, value in state.items():
        np.testing.assert_array_equal(got[key], value.float().numpy() if key == "bf16"
                                      else value.numpy())  # fmt: skip
    assert got["count"].shape == () and got["count"].dtype == np.int64
    assert got["bf16"].dtype == np.float32


def test_what_we_write_torch_loads_with_weights_only(tmp_path):
    state = {
        "w": np.arange(12, dtype=np.float32).reshape(3, 4)[:, ::2],  # not contiguous
        "b": np.zeros(0, dtype=np.float32),
        "n": np.array(5, dtype=np.int64),
    }
    write_pth(state, tmp_path / "ours.pth")
    back = torch.load(tmp_path / "ours.pth", weights_only=True)
    assert list(back) == list(state)
    for key, value in state.items():
        assert tuple(back[key].shape) == value.shape
        np.testing.assert_array_equal(back[key].numpy(), value)
    assert {k: v.dtype for k, v in read_pth(tmp_path / "ours.pth").items()} == {
        k: v.dtype for k, v in state.items()
    }


def test_anything_but_tensors_and_dicts_is_refused(tmp_path):
    torch.save({"w": torch.zeros(2), "x": Exception("runs code")}, tmp_path / "evil.pth")
    with pytest.raises(PthError, match="names builtins.Exception|names exceptions.Exception"):
        read_pth(tmp_path / "evil.pth")
    with zipfile.ZipFile(tmp_path / "two.pth", "w") as z:
        z.writestr("a/data.pkl", b"")
        z.writestr("b/data.pkl", b"")
    with pytest.raises(PthError, match="2 data.pkl records"):
        read_pth(tmp_path / "two.pth")
    (tmp_path / "pickle.pth").write_bytes(b"\x80\x02a pickle, not a zip")  # no torch magic
    with pytest.raises(PthError, match="not a PyTorch file"):
        read_pth(tmp_path / "pickle.pth")
    with pytest.raises(PthError, match="no PyTorch storage type"):
        write_pth({"c": np.zeros(2, dtype=np.complex64)}, tmp_path / "c.pth")
