"""Augmentation spec, per-sample random numbers and crop boxes, and the normalise step.

Spec string (`--augment`), ops joined by '+':
  none      base transform only: centre crop to the data set's sample size, normalise
  cropP     pad P pixels of zeros on each side, random crop back to the sample size (CIFAR)
  rcropS    random S x S crop (validation: centre S x S crop)
  rrcS      random-resized crop to S x S: area 8-100 %, aspect 3/4-4/3 (ImageNet style);
            validation: resize the shorter side to int(S / 0.875), centre S x S crop
  flip      horizontal flip with probability 1/2
At most one of crop/rcrop/rrc; P and S at most MAX_CROP (an S x S float32 sample of 8192 is
768 MiB; rrc99999 asked numpy for 18.6 TiB). Validation (train=False) never draws random numbers.

Shapes: training and validation both yield S x S with rcropS and rrcS, and the data set's
sample size otherwise (`Augment.output_hw`; `hpcdl.data.batch.output_shape` is the contract
the model, the start-up checks and the benchmarks read). The validation transforms of rcropS and
rrcS are torchvision's `CenterCrop(S)` and `Resize(int(S / 0.875)) + CenterCrop(S)`, with their
rounding (`eval_resize_hw`, centre offsets int(round((h - S) / 2))).

Random numbers are a hash of (seed, epoch, sample index, draw number) (SplitMix64), so a sample's
augmentation does not depend on which worker builds it, on the batch it is in, or on K.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

RRC_SCALE = (0.08, 1.0)
RRC_RATIO = (3 / 4, 4 / 3)
RRC_ATTEMPTS = 10
VAL_RESIZE_FRACTION = 0.875  # validation of rrcS: shorter side S / 0.875, centre crop S

MAX_CROP = 8192  # the largest P of cropP and S of rcropS and rrcS
_TOKEN = re.compile(r"^(crop|rcrop|rrc)([0-9]+)$")


@dataclass(frozen=True)
class Augment:
    pad: int = 0  # cropP
    crop: int = 0  # rcropS
    rrc: int = 0  # rrcS
    flip: bool = False

    @property
    def size(self) -> int:
        """Output side set by the spec (0: the data set's own sample size)."""
        return self.crop or self.rrc

    def output_hw(self, base_hw: tuple[int, int]) -> tuple[int, int]:
        """(H, W) of the samples, training and validation alike, for a data set whose smallest
        image is base_hw."""
        return (self.size, self.size) if self.size else (int(base_hw[0]), int(base_hw[1]))


def parse_augment(spec: str | None) -> Augment:
    """Parse 'none', 'crop4+flip', 'rrc224+flip', ...; ValueError names the bad token."""
    spec = (spec or "none").strip().lower()
    if spec == "none":
        return Augment()
    fields: dict = {}
    for token in spec.split("+"):
        m = _TOKEN.match(token)
        if token == "flip":
            fields["flip"] = True
        elif m and (m.group(1) == "crop" or int(m.group(2)) > 0):
            if int(m.group(2)) > MAX_CROP:
                raise ValueError(
                    f"--augment {spec!r}: {token} is larger than {MAX_CROP}, the most "
                    f"{m.group(1)} takes; give {m.group(1)}{MAX_CROP} or less"
                )
            key = {"crop": "pad", "rcrop": "crop", "rrc": "rrc"}[m.group(1)]
            fields[key] = int(m.group(2))
        else:
            raise ValueError(
                f"--augment: unknown op {token!r} in {spec!r}; use 'none' or ops joined by '+': "
                "cropP (pad P, random crop), rcropS, rrcS, flip"
            )
    if sum(1 for k in ("pad", "crop", "rrc") if k in fields) > 1:
        raise ValueError(f"--augment {spec!r}: use at most one of cropP, rcropS, rrcS")
    return Augment(**fields)


_G = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _mix(z: np.ndarray) -> np.ndarray:
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def uniforms(seed: int, epoch: int, indices: np.ndarray, draws: int) -> np.ndarray:
    """(B, draws) float64 in [0, 1), a pure function of (seed, epoch, index, draw)."""
    with np.errstate(over="ignore"):
        s = np.array([seed, epoch], dtype=np.uint64)
        h = _mix(_mix(s[0:1] + _G) ^ (s[1:2] * _G + _G))
        h = _mix(h ^ (np.asarray(indices, np.int64).astype(np.uint64) * _G + _G))
        k = np.arange(1, draws + 1, dtype=np.uint64) * _G
        z = _mix(h[:, None] ^ k[None, :])
    return (z >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


@dataclass
class Boxes:
    """Per-sample crop boxes (in padded coordinates when pad > 0) and flips, all (B,) int64."""

    y0: np.ndarray
    x0: np.ndarray
    h: np.ndarray
    w: np.ndarray
    flip: np.ndarray  # bool
    out_hw: tuple[int, int]
    pad: int

    @property
    def needs_resize(self) -> bool:
        oh, ow = self.out_hw
        return bool(np.any(self.h != oh) or np.any(self.w != ow))


def crop_boxes(
    aug: Augment,
    hs: np.ndarray,
    ws: np.ndarray,
    base_hw: tuple[int, int],
    seed: int,
    epoch: int,
    indices: np.ndarray,
    train: bool,
) -> Boxes:
    """Boxes for images of heights hs and widths ws (B,), vectorised over the batch."""
    hs, ws = np.asarray(hs, np.int64), np.asarray(ws, np.int64)
    n = len(hs)
    oh, ow = aug.output_hw(base_hw)
    u = uniforms(seed, epoch, indices, 3 + 4 * RRC_ATTEMPTS) if train else None
    flip = (u[:, 0] < 0.5) if (train and aug.flip) else np.zeros(n, bool)
    pad = aug.pad if train else 0
    if train and aug.rrc:
        y0, x0, h, w = _rrc_boxes(hs, ws, u[:, 3:])
    elif aug.rrc:
        raise ValueError("validation of rrcS resizes the whole image: use eval_resize_hw")
    else:
        h, w = np.minimum(hs + 2 * pad, oh), np.minimum(ws + 2 * pad, ow)
        if train and (aug.crop or pad):
            y0 = np.floor(u[:, 1] * (hs + 2 * pad - h + 1)).astype(np.int64)
            x0 = np.floor(u[:, 2] * (ws + 2 * pad - w + 1)).astype(np.int64)
        elif aug.crop:  # torchvision's CenterCrop rounds half offsets to even
            y0 = np.round((hs - h) / 2.0).astype(np.int64)
            x0 = np.round((ws - w) / 2.0).astype(np.int64)
        else:
            y0, x0 = (hs + 2 * pad - h) // 2, (ws + 2 * pad - w) // 2
    return Boxes(y0, x0, h, w, flip, (oh, ow), pad)


def eval_resize_hw(h: int, w: int, size: int) -> tuple[int, int]:
    """(H, W) that validation of rrc`size` resizes an h x w image to before its centre crop.

    torchvision's Resize(int(size / 0.875)): the shorter side becomes that, the longer one
    int(short * long / shorter)."""
    short = int(size / VAL_RESIZE_FRACTION)
    if h <= w:
        return short, int(short * w / h)
    return int(short * h / w), short


def eval_resize_crop(img: np.ndarray, resize_hw: tuple[int, int], size: int) -> np.ndarray:
    """Resize an (h, w, C) uint8 image to resize_hw (bilinear), then centre-crop size x size."""
    rh, rw = resize_hw
    region = resize_to(img, (rh, rw))
    top, left = int(round((rh - size) / 2.0)), int(round((rw - size) / 2.0))
    return region[top : top + size, left : left + size]


def _rrc_boxes(hs: np.ndarray, ws: np.ndarray, u: np.ndarray):
    """Random-resized-crop boxes; u is (B, 4 * RRC_ATTEMPTS). Fallback: centre square crop."""
    area = (hs * ws)[:, None].astype(np.float64)
    lo, hi = np.log(RRC_RATIO[0]), np.log(RRC_RATIO[1])
    a = RRC_ATTEMPTS
    target = area * (RRC_SCALE[0] + (RRC_SCALE[1] - RRC_SCALE[0]) * u[:, :a])
    ratio = np.exp(lo + (hi - lo) * u[:, a : 2 * a])
    w = np.round(np.sqrt(target * ratio)).astype(np.int64)
    h = np.round(np.sqrt(target / ratio)).astype(np.int64)
    ok = (w > 0) & (h > 0) & (w <= ws[:, None]) & (h <= hs[:, None])
    first = np.argmax(ok, axis=1)
    rows = np.arange(len(hs))
    found = ok[rows, first]
    h, w = h[rows, first], w[rows, first]
    uy, ux = u[rows, 2 * a + first], u[rows, 3 * a + first]
    side = np.minimum(hs, ws)
    h, w = np.where(found, h, side), np.where(found, w, side)
    y0 = np.where(found, np.floor(uy * (hs - h + 1)), (hs - side) // 2).astype(np.int64)
    x0 = np.where(found, np.floor(ux * (ws - w + 1)), (ws - side) // 2).astype(np.int64)
    return y0, x0, h, w


def gather_crops(x: np.ndarray, boxes: Boxes) -> np.ndarray:
    """Crop (and flip) a same-size batch x (B, H, W, C) with one gather: (B, C, oh, ow).

    Only for boxes whose size equals the output size (no resize). The gather picks one window
    per sample from a sliding-window view, so it copies B blocks, not B*oh*ow indices."""
    from numpy.lib.stride_tricks import sliding_window_view  # noqa: PLC0415

    if boxes.pad:
        p = boxes.pad
        x = np.pad(x, ((0, 0), (p, p), (p, p), (0, 0)))
    if x.shape[1:3] == boxes.out_hw and not boxes.flip.any():
        return x.transpose(0, 3, 1, 2)
    windows = sliding_window_view(x, boxes.out_hw, axis=(1, 2))  # (B, nh, nw, C, oh, ow)
    crops = windows[np.arange(len(x)), boxes.y0, boxes.x0]
    if boxes.flip.any():
        crops[boxes.flip] = crops[boxes.flip][..., ::-1]
    return crops


def resize_to(region: np.ndarray, out_hw: tuple[int, int]) -> np.ndarray:
    """Bilinear resize of an (h, w, C) uint8 region to out_hw (no-op when it already fits)."""
    from PIL import Image  # noqa: PLC0415

    oh, ow = out_hw
    if region.shape[:2] == (oh, ow):
        return region
    channels = region.shape[2]
    pil = Image.fromarray(region[:, :, 0] if channels == 1 else np.ascontiguousarray(region))
    return np.asarray(pil.resize((ow, oh), Image.BILINEAR)).reshape(oh, ow, channels)


def crop_one(img: np.ndarray, boxes: Boxes, i: int, scale: tuple[float, float] = (1.0, 1.0)):
    """Crop, resize (bilinear) and flip one HWC uint8 image to the output size.

    scale: decoded size / indexed size (JPEG draft decoding shrinks the image)."""
    if boxes.pad:
        p = boxes.pad
        img = np.pad(img, ((p, p), (p, p), (0, 0)))
    sy, sx = scale
    y0, x0 = int(boxes.y0[i] * sy), int(boxes.x0[i] * sx)
    h, w = max(1, int(round(boxes.h[i] * sy))), max(1, int(round(boxes.w[i] * sx)))
    region = resize_to(img[y0 : y0 + h, x0 : x0 + w], boxes.out_hw)
    return region[:, ::-1] if boxes.flip[i] else region


def normalise_into(out: np.ndarray, x: np.ndarray, mean: np.ndarray, std: np.ndarray) -> None:
    """out (B, C, H, W) float32 = (x (B, C, H, W) - mean) / std, per channel."""
    np.subtract(x, mean.astype(np.float32)[:, None, None], out=out, dtype=np.float32)
    np.multiply(out, (1.0 / std).astype(np.float32)[:, None, None], out=out)
