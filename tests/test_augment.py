"""Augmentation: spec parsing, per-sample seeding, crop/flip geometry, deterministic validation."""

import numpy as np
import pytest

from hpcdl.data.augment import (
    Augment,
    crop_boxes,
    eval_resize_crop,
    eval_resize_hw,
    gather_crops,
    parse_augment,
    uniforms,
)


def test_spec_parsing():
    assert parse_augment("none") == parse_augment(None) == Augment()
    assert parse_augment("crop4+flip") == Augment(pad=4, flip=True)
    assert parse_augment("rrc224+flip") == Augment(rrc=224, flip=True)
    assert parse_augment("rcrop28").output_hw((32, 32)) == (28, 28)
    for bad in ("crop", "blur3", "crop4+rrc8", "rrc0"):
        with pytest.raises(ValueError, match="--augment"):
            parse_augment(bad)


def test_random_numbers_depend_only_on_seed_epoch_and_sample():
    a = uniforms(1, 2, np.array([5, 9, 7]), 4)
    b = uniforms(1, 2, np.array([7, 5]), 4)
    np.testing.assert_array_equal(a[[2, 0]], b)
    assert not np.array_equal(a, uniforms(1, 3, np.array([5, 9, 7]), 4))
    assert not np.array_equal(a, uniforms(2, 2, np.array([5, 9, 7]), 4))
    u = uniforms(0, 0, np.arange(20000), 2)
    assert 0 <= u.min() and u.max() < 1 and abs(u.mean() - 0.5) < 0.01


def test_pad_crop_and_flip_match_a_per_sample_reference():
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (64, 6, 7, 2), dtype=np.uint8)
    idx = np.arange(100, 164)
    aug = parse_augment("crop2+flip")
    boxes = crop_boxes(aug, np.full(64, 6), np.full(64, 7), (6, 7), 3, 1, idx, train=True)
    out = gather_crops(x, boxes).transpose(0, 2, 3, 1)
    assert out.shape == (64, 6, 7, 2)
    assert 10 < boxes.flip.sum() < 54 and len(set(boxes.y0.tolist())) == 5
    for i in range(64):
        p = np.pad(x[i], ((2, 2), (2, 2), (0, 0)))
        ref = p[boxes.y0[i] : boxes.y0[i] + 6, boxes.x0[i] : boxes.x0[i] + 7]
        np.testing.assert_array_equal(out[i], ref[:, ::-1] if boxes.flip[i] else ref)


def test_validation_is_a_deterministic_centre_crop():
    hs, ws = np.array([256, 300]), np.array([256, 200])
    for spec in ("rcrop224+flip", "crop4+flip"):
        aug = parse_augment(spec)
        a = crop_boxes(aug, hs, ws, (256, 200), 0, 0, np.array([1, 2]), train=False)
        b = crop_boxes(aug, hs, ws, (256, 200), 9, 7, np.array([1, 2]), train=False)
        assert not a.flip.any() and a.pad == 0
        for f in ("y0", "x0", "h", "w"):
            np.testing.assert_array_equal(getattr(a, f), getattr(b, f))
    c = crop_boxes(parse_augment("rcrop224"), hs, ws, (256, 200), 0, 0, np.array([1, 2]), False)
    assert c.y0.tolist() == [16, 38] and c.h.tolist() == [224, 224] and c.w.tolist() == [224, 200]
    # torchvision's CenterCrop: offset int(round((h - S) / 2)), halves to even
    odd = crop_boxes(parse_augment("rcrop4"), [7, 9], [9, 7], (7, 7), 0, 0, np.arange(2), False)
    assert odd.y0.tolist() == [2, 2] and odd.x0.tolist() == [2, 2]


def test_validation_of_rrc_resizes_as_torchvision():
    """Resize(int(S / 0.875)): shorter side int(S / 0.875), longer int(short * long / shorter)."""
    assert eval_resize_hw(375, 500, 224) == (256, 341)
    assert eval_resize_hw(500, 375, 224) == (341, 256)
    assert eval_resize_hw(64, 64, 48) == (54, 54)  # int(54.86), not round()
    img = np.arange(9 * 12 * 1, dtype=np.uint8).reshape(9, 12, 1)
    assert eval_resize_crop(img, (9, 12), 8).shape == (8, 8, 1)
    np.testing.assert_array_equal(eval_resize_crop(img, (9, 12), 8), img[0:8, 2:10])
    with pytest.raises(ValueError, match="eval_resize_hw"):
        crop_boxes(parse_augment("rrc8"), [9], [12], (9, 12), 0, 0, np.arange(1), train=False)


def test_random_resized_crop_boxes_lie_inside_the_image():
    n = 2000
    hs = np.random.default_rng(0).integers(50, 400, n)
    ws = np.random.default_rng(1).integers(50, 400, n)
    b = crop_boxes(parse_augment("rrc32"), hs, ws, (0, 0), 0, 0, np.arange(n), train=True)
    assert (b.y0 >= 0).all() and (b.x0 >= 0).all() and (b.h >= 1).all() and (b.w >= 1).all()
    assert (b.y0 + b.h <= hs).all() and (b.x0 + b.w <= ws).all()
    frac = b.h * b.w / (hs * ws)
    assert frac.min() >= 0.07 and frac.max() <= 1.0 and b.out_hw == (32, 32)
