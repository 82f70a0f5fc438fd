"""`python -m hpcdl.bench input`: does the input pipeline keep a training step fed?

    python -m hpcdl.bench input [--device gpu|cpu] [--data DIR] [--make-jpegs N]
                                [--image-size 500x375] [--workers 8,15] [--batch-size B]
                                [--steps 40] [--warmup 5] [--model M] [--json F]

--make-jpegs writes the folder where --data does not exist yet, one process per core (about
9 CPU-seconds per 1,000 JPEGs of 500x375, ~120 KB each), and says how long it took.

One run times the same step (`--model`) fed four ways, on the same JPEG folder and augmentation
(`--augment`, default rrc224+flip): `none` (one batch kept on the device: the step's own rate),
torch's `dataloader` (pin_memory where CUDA is, persistent workers, prefetch_factor 2 and 4; each
sample built by hpcdl's own per-sample code, so the decode work is the same), and
`hpcdl.torch.Loader` with default slots, decode `cpu` (`hpcdl`) and `gpu` (`hpcdl-gpu`: the
workers read bytes, the script's process decodes: nvImageCodec on a GPU, Pillow on the CPU).
A last row, `decoder`, times that decoding alone (no workers, no step): the batches' files read
beforehand, then decoded by the decoder alone and decoded, cropped, flipped and normalised as
`hpcdl-gpu` does, each until the device is done: whether the GPU path could keep the step fed.
Per row: images/s over `--steps` steps after `--warmup`, and the data-wait share: the time the
script spent inside next() over the timed wall time. A GPU step is not synchronised per step (as
in a real script), so a wait there is host time while the GPU still has queued work.

Models: resnet50 (torchvision's, hpcdl.bench.torch_models; bf16 autocast and channels_last on a
GPU), linear (one dense layer: next to nothing), or sleep:MS (the host waits MS milliseconds
without using a core, like a queued GPU step: the CPU stand-in for a fast GPU, and the default
with --device cpu). `--json F` appends one JSON line per row as it is timed (docs/PERFORMANCE.md,
issue 48).
Needs torch (the bench extra).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hpcdl.helpformat import HelpFormatter


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m hpcdl.bench input",
        description=__doc__.split("\n")[0].split(": ", 1)[1],
        formatter_class=HelpFormatter,
        allow_abbrev=False,
    )
    p.add_argument("--device", choices=("cpu", "gpu"), default="cpu", help="where the step runs")
    p.add_argument(
        "--data",
        help="JPEG folder root/<class>/<file>; written there (--make-jpegs) where it does not "
        "exist, so that several runs share it (default: a temporary one)",
    )
    p.add_argument("--make-jpegs", type=int, default=512, help="JPEGs to write")
    p.add_argument(
        "--image-size",
        type=image_size,
        default=(320, 320),
        help="size of the JPEGs it writes: SIDE or WIDTHxHEIGHT (ImageNet's typical 500x375)",
    )
    p.add_argument(
        "--make-processes",
        type=int,
        default=0,
        help="processes that write the JPEGs (default: one per core)",
    )
    p.add_argument("--workers", default="2", help="loader workers per row, comma-separated")
    p.add_argument("--batch-size", type=int, default=32, help="images per step")
    p.add_argument("--steps", type=int, default=40, help="timed steps per row")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps before them")
    p.add_argument("--augment", default="rrc224+flip", help="hpcdl --augment spec")
    p.add_argument(
        "--model",
        default=None,
        help="resnet50, linear, or sleep:MS (default: resnet50 on gpu, sleep:20 on cpu)",
    )
    p.add_argument(
        "--rows",
        default="none,dataloader,hpcdl,hpcdl-gpu,decoder",
        help="which rows to time, comma-separated (hpcdl-gpu: --decode gpu; with --device gpu "
        "only where nvImageCodec is available, with --device cpu the rank decodes with Pillow; "
        "decoder: --decode gpu's decoding and cropping alone, no workers and no step)",
    )
    p.add_argument(
        "--prefetch", type=int, help="batch slots of the hpcdl rows (default: hpcdl's default)"
    )
    p.add_argument("--json", help="append one JSON line per row to this file")
    return p


def image_size(text: str) -> tuple[int, int]:
    """--image-size: SIDE or WIDTHxHEIGHT, as (width, height)."""
    parts = text.lower().split("x")
    try:
        size = tuple(int(v) for v in parts)
    except ValueError:
        size = ()
    if len(size) not in (1, 2) or min(size) < 8:
        raise argparse.ArgumentTypeError(f"SIDE or WIDTHxHEIGHT, each at least 8, not {text!r}")
    return (size[0], size[-1])


# ------------------------------------------------------------------ the data


def _write_jpeg_range(root: str, start: int, stop: int, width: int, height: int) -> None:
    """Images start..stop-1 of make_jpegs, quality 90: 127 + 100 sin(fx x + fy y) per channel
    (random frequencies, as synthetic.smooth_noise, which JPEG compresses like a photo: about
    120 KB at 500x375) plus noise (std 30) cut at a random place from one bank of noise drawn
    per call: an image costs a few milliseconds, not a fresh draw of its every pixel."""
    from hpcdl.bench import synthetic  # noqa: PLC0415

    rng = np.random.default_rng(start)
    bank = rng.normal(0, 30, (2 * height, 2 * width, 3)).astype(np.float32)
    x = np.arange(width, dtype=np.float32)[:, None]
    y = np.arange(height, dtype=np.float32)[:, None, None]
    for i in range(start, stop):
        f = rng.uniform(0.01, 0.1, 3).astype(np.float32)
        ax, by = x * f, y * f[::-1]  # sin(a + b) = sin a cos b + cos a sin b: two outer products
        base = np.sin(ax) * np.cos(by) + np.cos(ax) * np.sin(by)
        oy, ox = rng.integers(0, height), rng.integers(0, width)
        pixels = 127 + 100 * base + bank[oy : oy + height, ox : ox + width]
        folder = Path(root) / f"c{i % 10}"
        folder.mkdir(parents=True, exist_ok=True)
        synthetic.save(folder / f"{i:06d}.jpg", np.clip(pixels, 0, 255).astype(np.uint8))


def make_jpegs(root: Path, count: int, width: int, height: int, processes: int = 0) -> None:
    """count JPEGs of width x height in root/c<class>/ (ten classes), written by `processes`
    processes (0: one per core) into root's sibling `<name>.partial`, renamed to root when all
    are written: an interrupted run leaves no folder that a later one would take as made."""
    import os  # noqa: PLC0415
    import shutil  # noqa: PLC0415
    from concurrent.futures import ProcessPoolExecutor  # noqa: PLC0415

    partial = root.with_name(root.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    processes = max(1, min(processes or os.cpu_count() or 1, count // 64 or 1))
    chunk = -(-count // processes)
    starts = range(0, count, chunk)
    with ProcessPoolExecutor(processes) as pool:
        done = [pool.submit(_write_jpeg_range, str(partial), s, min(s + chunk, count), width,
                            height) for s in starts]  # fmt: skip
        for future in done:
            future.result()
    partial.rename(root)


# ------------------------------------------------------------------ the step


def torch_resnet50() -> Any:
    """torchvision's resnet50 where torchvision is installed, else the same network from
    hpcdl.bench.torch_models (the compute bench's PyTorch peer)."""
    try:
        from torchvision.models import resnet50  # noqa: PLC0415
    except ImportError:
        from hpcdl.bench.torch_models import imagenet_resnet  # noqa: PLC0415

        return imagenet_resnet("resnet50", num_classes=1000)
    return resnet50(num_classes=1000)


def make_step(model: str, device: str, batch: int, shape: tuple[int, int, int]):
    """(step(images, labels), name, precision, torch device string). The step only queues work
    on a GPU; sleep:MS waits on the host without a core."""
    import torch  # noqa: PLC0415

    dev = "cuda" if device == "gpu" else "cpu"
    if model.startswith("sleep:"):
        seconds = float(model.split(":", 1)[1]) / 1000

        def sleep_step(images, labels) -> None:
            time.sleep(seconds)

        return sleep_step, model, "none", dev
    if model not in ("resnet50", "linear"):
        raise SystemExit(f"--model must be resnet50, linear or sleep:MS, got {model!r}")
    if model == "resnet50":
        net = torch_resnet50()
    else:
        net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(int(np.prod(shape)), 1000))
    gpu = dev == "cuda"
    net = net.to(dev, memory_format=torch.channels_last) if gpu else net.to(dev)
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    precision = "bf16" if gpu else "fp32"

    def step(images, labels) -> None:
        x = images.to(dev, non_blocking=True)
        y = labels.to(dev, non_blocking=True)
        if gpu:
            x = x.contiguous(memory_format=torch.channels_last)
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=gpu):
            loss = loss_fn(net(x), y % 1000)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step, model, precision, dev


def timed_steps(batches: Iterable, step: Callable, warmup: int, steps: int, sync) -> dict:
    """Run warmup + steps steps; images/s and the share of the timed wall time spent in next()."""
    it = iter(batches)
    for _ in range(warmup):
        step(*next(it))
    sync()
    waited, images = 0.0, 0
    t0 = time.perf_counter()
    for _ in range(steps):
        w0 = time.perf_counter()
        x, y = next(it)
        waited += time.perf_counter() - w0
        step(x, y)
        images += len(y)
    sync()
    wall = time.perf_counter() - t0
    return {"images_per_s": images / wall, "data_wait_share": waited / wall}


# ------------------------------------------------------------------ the feeds


def _epochs(make_epoch: Callable[[int], Iterable]):
    """Batches from epoch 0, 1, ... without end (a row may need more than one pass)."""
    epoch = 0
    while True:
        yield from make_epoch(epoch)
        epoch += 1


def dataloader_feed(data: str, batch: int, workers: int, factor: int, augment: str, pin: bool):
    """torch DataLoader over hpcdl's sample order, each sample built by hpcdl's BatchBuilder."""
    import torch  # noqa: PLC0415
    from torch.utils.data import DataLoader, Dataset  # noqa: PLC0415

    from hpcdl.data import open_dataset  # noqa: PLC0415
    from hpcdl.data.augment import parse_augment  # noqa: PLC0415
    from hpcdl.data.batch import BatchBuilder, output_shape  # noqa: PLC0415
    from hpcdl.data.sampler import DistributedSampler  # noqa: PLC0415

    ds = open_dataset(data)
    aug = parse_augment(augment)
    shape = output_shape(ds, aug)

    class Samples(Dataset):
        builder = None

        def __len__(self) -> int:
            return len(ds)

        def __getitem__(self, key):
            epoch, i = key
            if Samples.builder is None:  # one per worker process, built there
                Samples.builder = BatchBuilder(ds, aug, 0)
            x, y = np.empty((1, *shape), np.float32), np.empty(1, np.int64)
            Samples.builder.build(np.array([i]), epoch, True, x, y)
            return torch.from_numpy(x[0]), int(y[0])

    class Order:
        def __iter__(self):
            epoch = 0
            while True:
                for b in DistributedSampler(len(ds), seed=0).batches(epoch, batch):
                    yield [(epoch, int(i)) for i in b]
                epoch += 1

    loader = DataLoader(
        Samples(),
        batch_sampler=Order(),
        num_workers=workers,
        pin_memory=pin,
        persistent_workers=True,
        prefetch_factor=factor,
    )
    return loader, shape


def hpcdl_feed(
    data: str, batch: int, workers: int, augment: str, prefetch: int | None, decode: str
):
    """hpcdl.torch.Loader (prefetch None: its default slots); (loader, batches without end)."""
    from hpcdl.torch import Loader  # noqa: PLC0415

    loader = Loader(
        data, batch, epochs=1000, workers=workers, augment=augment, prefetch=prefetch,
        decode=decode, handle_signals=False,
    )  # fmt: skip

    def epoch(e: int):
        loader.set_epoch(e)
        return loader

    return loader, _epochs(epoch)


def decoder_timing(data: str, batch: int, augment: str, gpu: bool, warmup: int, steps: int):
    """The rank's side of --decode gpu alone, without workers or a step: up to 16 batches' files
    read into byte slots (untimed), then `steps` batches after `warmup` decoded by the decoder
    alone, and built by GpuBatchDecoder.build (decode, crop, flip, normalise), each timed
    until the device is done. {"images_per_s": built, "decode_images_per_s": decoded alone,
    "decoder": its name}. On the CPU the decoder is Pillow in this process."""
    from hpcdl.data import open_dataset  # noqa: PLC0415
    from hpcdl.data.augment import parse_augment  # noqa: PLC0415
    from hpcdl.data.file_bytes import FileBytesReader, byte_capacity  # noqa: PLC0415
    from hpcdl.data.gpu_decode import GpuBatchDecoder  # noqa: PLC0415
    from hpcdl.data.sampler import DistributedSampler  # noqa: PLC0415

    xp: Any = np
    if gpu:
        import cupy as xp  # noqa: PLC0415
    ds = open_dataset(data)
    order = DistributedSampler(len(ds), seed=0).batches(0, batch)[:16]
    if not order:
        raise SystemExit(f"--rows decoder: {data} holds fewer than one batch of {batch} images")
    reader, slots = FileBytesReader(ds), []
    try:
        for indices in order:
            offsets, labels = np.empty(batch + 1, np.int64), np.empty(batch, np.int64)
            buffer = np.empty(byte_capacity(ds, batch), np.uint8)
            reader.read(indices, labels, offsets, buffer)
            slots.append((indices, offsets, buffer, labels))
    finally:
        reader.close()
    gpu_decoder = GpuBatchDecoder(ds, parse_augment(augment), 0, xp)

    def rate(work: Callable[[tuple], Any]) -> float:
        for k in range(warmup + steps):
            if k == warmup:
                if gpu:
                    xp.cuda.Device().synchronize()
                t0 = time.perf_counter()
            work(slots[k % len(slots)])
        if gpu:
            xp.cuda.Device().synchronize()
        return steps * batch / (time.perf_counter() - t0)

    def decode(slot: tuple) -> Any:
        indices, offsets, buffer, _ = slot
        blobs = [buffer[offsets[i] : offsets[i + 1]] for i in range(len(indices))]
        return gpu_decoder.decoder.decode(blobs)

    def build(slot: tuple) -> Any:
        indices, offsets, buffer, labels = slot
        return gpu_decoder.build(indices, offsets, buffer, labels, epoch=0)

    decoded = rate(decode)
    return {"images_per_s": rate(build), "data_wait_share": 0.0,
            "decode_images_per_s": decoded, "decoder": gpu_decoder.decoder.name}  # fmt: skip


# ------------------------------------------------------------------ the rows


@dataclass
class Table:
    """The rows timed so far; each is written (--json) and printed as it is timed, so a run cut
    short by a time limit keeps the rows it timed. model, precision and device: the step's."""

    args: Any
    out: list[dict[str, Any]] = field(default_factory=list)
    model: str = "-"
    precision: str = "-"
    device: str = "cpu"

    def record(self, loader: str, decode: str, workers, slots, default: bool, timing: dict):
        row = dict(loader=loader, decode=decode, workers=workers, slots=slots,
                   slots_default=default, batch=self.args.batch_size, model=self.model,
                   precision=self.precision, device=self.device, **timing)  # fmt: skip
        self.out.append(row)
        if self.args.json:
            with open(self.args.json, "a") as f:
                f.write(json.dumps(row) + "\n")
        print(
            f"{loader:10} decode {decode:4} workers {workers!s:>3} slots {slots!s:>4}: "
            f"{row['images_per_s']:9.1f} images/s, data wait {100 * row['data_wait_share']:5.1f} %",
            flush=True,
        )


def rows(args, data: str) -> list[dict[str, Any]]:
    """Time each requested row; one dict per row with the issue's JSON fields."""
    import torch  # noqa: PLC0415

    from hpcdl.data.gpu_decode import gpu_decode_available  # noqa: PLC0415

    wanted = set(args.rows.split(","))
    model = args.model or ("resnet50" if args.device == "gpu" else "sleep:20")
    gpu = args.device == "gpu"
    if gpu and not torch.cuda.is_available():
        raise SystemExit("--device gpu: torch sees no CUDA device")
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    gpu_decode = not gpu or gpu_decode_available()[0]  # with --device cpu: Pillow in the rank
    table = Table(args, device=torch.cuda.get_device_name() if gpu else "cpu")
    record = table.record
    for workers in (int(w) for w in args.workers.split(",")):
        dl, shape = dataloader_feed(data, args.batch_size, max(workers, 1), 2, args.augment, gpu)
        step, table.model, table.precision, dev = make_step(
            model, args.device, args.batch_size, shape
        )
        if "none" in wanted and not any(r["loader"] == "none" for r in table.out):
            x, y = next(iter(dl))
            x, y = x.to(dev), y.to(dev)
            record("none", "-", None, None, False,
                   timed_steps(_repeat(x, y), step, args.warmup, args.steps, sync))  # fmt: skip
        if "dataloader" in wanted:
            for factor in (2, 4):
                if factor != 2:
                    dl, _ = dataloader_feed(
                        data, args.batch_size, workers, factor, args.augment, gpu
                    )
                timing = timed_steps(dl, step, args.warmup, args.steps, sync)
                record("dataloader", "cpu", workers, factor * workers, False, timing)
                del dl
        for decode, row in (("cpu", "hpcdl"), ("gpu", "hpcdl-gpu")):
            if row not in wanted or (decode == "gpu" and not gpu_decode):
                continue
            loader, batches = hpcdl_feed(
                data, args.batch_size, workers, args.augment, args.prefetch, decode
            )
            with loader:
                timing = timed_steps(batches, step, args.warmup, args.steps, sync)
                default = args.prefetch is None
                record("hpcdl", decode, workers, loader.slots, default, timing)
    if "decoder" in wanted and gpu_decode:
        decoder_row(table, data, gpu)
    return table.out


def decoder_row(table: Table, data: str, gpu: bool) -> None:
    """The `decoder` row (decoder_timing): no step, so no model or precision."""
    a = table.args
    table.model, table.precision = "-", "-"
    timing = decoder_timing(data, a.batch_size, a.augment, gpu, a.warmup, a.steps)
    table.record("decoder", "gpu", 0, None, False, timing)
    print(
        f"{'':10} {timing['decoder']} alone: {timing['decode_images_per_s']:9.1f} images/s "
        "decoded; the line above: decoded, cropped, flipped, normalised",
        flush=True,
    )


def _repeat(x, y):
    while True:
        yield x, y


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The flags, checked before any JPEG is written (ap.error, status 2)."""
    ap = build_parser()
    args = ap.parse_args(argv)
    least = {"make_jpegs": 1, "make_processes": 0, "batch_size": 1, "steps": 1, "warmup": 0}
    if args.prefetch is not None:
        least["prefetch"] = 1
    for name, low in least.items():
        if getattr(args, name) < low:
            ap.error(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(args, name)}")
    try:
        if min(int(w) for w in args.workers.split(",")) < 0:
            raise ValueError
    except ValueError:
        ap.error(f"--workers takes counts >= 0, comma-separated, got {args.workers!r}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="hpcdl-bench-input-") as tmp:
        data = args.data or str(Path(tmp) / "jpegs")
        if not Path(data).exists():
            t0 = time.perf_counter()
            make_jpegs(Path(data), args.make_jpegs, *args.image_size, args.make_processes)
            print(f"{args.make_jpegs} JPEGs of {args.image_size[0]}x{args.image_size[1]} "
                  f"written in {time.perf_counter() - t0:.1f} s", flush=True)  # fmt: skip
        rows(args, data)
    return 0
