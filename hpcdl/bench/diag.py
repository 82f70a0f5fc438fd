"""`python -m hpcdl.bench diag`: what recording events (hpcdl.diag) costs a training step.

One process, synthetic data, hpcdl.nn.step.train_step, three variants interleaved round by round
(each first in turn) in the same run: `off` (the step's recording calls replaced by no-ops),
`ring` (what every run does: events into the ring and the heartbeat slot) and `timeline` (the
ring plus a thread that drains it into a --timeline buffer every second). Prints, per model,
the median step time of each variant and the ratios to `off`, and the cost of recording a step
of a multi-rank run measured alone (a data wait, forward, backward, the comm wait, the
optimizer, two buckets' allreduces, two small collectives) as a share of the step: the bound
that the ratios must agree with, within the noise of the machine.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from hpcdl import diag, nn
from hpcdl.diag import timeline
from hpcdl.helpformat import HelpFormatter
from hpcdl.nn.step import StepParts, train_step

SHAPE, CLASSES = (3, 32, 32), 10  # one CIFAR-sized sample, 10 classes


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m hpcdl.bench diag", description=__doc__.split("\n")[0],
        formatter_class=HelpFormatter, allow_abbrev=False,
    )  # fmt: skip
    ap.add_argument("--models", default="cnn,resnet20", help="models, comma-separated")
    ap.add_argument("--batch-size", type=int, default=32, help="samples per step")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per variant and round")
    ap.add_argument("--rounds", type=int, default=5, help="rounds over the three variants")
    return ap


def event_cost_us(n: int = 200_000) -> float:
    """Microseconds per ring.record() call, measured alone."""
    ring = diag.Recorder()
    t0 = time.perf_counter()
    for i in range(n):
        ring.record(diag.Kind.FORWARD, 1.0, 2.0, i)
    return (time.perf_counter() - t0) / n * 1e6


def step_recording_us(buckets: int = 2, n: int = 20_000) -> float:
    """Microseconds of what one step of a multi-rank run records, alone: the data wait, two
    collective spans (the stop agreement, and the loss check that a logged step adds: an
    upper bound for the others), forward, backward, the comm wait (entered, then recorded),
    the optimizer, and `buckets` allreduces from the comm thread's side."""
    ring, K = diag.Recorder(), diag.Kind
    t0 = time.perf_counter()
    for step in range(n):
        ring.begin_step(step)
        with ring.span(K.DATA_WAIT):
            pass
        ring.record(K.FORWARD, 1.0, 2.0)
        ring.record(K.BACKWARD, 2.0, 3.0)
        ring.enter(K.COMM_WAIT, 3.0)
        for _ in range(buckets):
            ring.record_aside(K.ALLREDUCE, 2.5, 3.5, 1 << 20)
        ring.record(K.COMM_WAIT, 3.0, 4.0)
        ring.record(K.OPTIMIZER, 4.0, 5.0)
        for _ in range(2):
            with ring.span(K.SYNC):
                pass
    return (time.perf_counter() - t0) / n * 1e6


class Variant:
    """Switches the step's recording off, on, or on with a draining timeline thread."""

    def __init__(self, name: str, folder: Path) -> None:
        self.name, self.folder = name, folder
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Variant:
        if self.name == "off":
            diag.record = lambda *args, **kwargs: None
            diag.RECORDER.enter = lambda *args, **kwargs: 0.0
        if self.name == "timeline":
            who = {"rank": 0, "host": "bench", "node": 0, "world_size": 1}
            writer = timeline.TimelineWriter(str(self.folder / "t.json"), who, 0.0)

            def drain() -> None:
                while not self._stop.wait(timeline.DRAIN_S):
                    writer.drain()
                writer.close()

            self._thread = threading.Thread(target=drain, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        diag.record = diag.RECORDER.record
        vars(diag.RECORDER).pop("enter", None)  # the class's method again
        if self._thread is not None:
            self._stop.set()
            self._thread.join()


def time_steps(parts: StepParts, images, labels, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        train_step(parts, images, labels, 0.01)
        times.append(time.perf_counter() - t0)
    return times


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The flags, checked (ap.error, status 2): counts >= 1, every model buildable."""
    ap = build_parser()
    args = ap.parse_args(argv)
    for name in ("batch_size", "steps", "rounds"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    args.built = {}
    for name in args.models.split(","):
        try:
            args.built[name] = nn.build_model(name, SHAPE, CLASSES, seed=0)
        except ValueError as exc:  # an unknown name, a user's builder that fails: one line
            ap.error(f"--models: {exc}")
    return args


def bench_model(model: nn.Model, args: argparse.Namespace, folder: Path) -> dict[str, float]:
    rng = np.random.default_rng(0)
    images = rng.standard_normal((args.batch_size, *SHAPE), dtype=np.float32)
    labels = rng.integers(0, CLASSES, args.batch_size)
    parts = StepParts(model, nn.make_optimizer("sgd", model.params, model.grads, momentum=0.9))
    time_steps(parts, images, labels, 3)  # warm-up
    samples: dict[str, list[float]] = {"off": [], "ring": [], "timeline": []}
    names = list(samples)
    for r in range(args.rounds):
        for variant in names[r % 3 :] + names[: r % 3]:  # each variant first in turn
            with Variant(variant, folder):
                samples[variant] += time_steps(parts, images, labels, args.steps)
    return {v: statistics.median(s) for v, s in samples.items()}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cost, per_step = event_cost_us(), step_recording_us()
    print(f"one recorded event: {cost:.2f} us; one step's events (2 buckets): {per_step:.1f} us")
    with tempfile.TemporaryDirectory() as tmp:
        for name, model in args.built.items():
            median = bench_model(model, args, Path(tmp))
            bound = per_step * 1e-6 / median["off"]
            print(
                f"{name} batch {args.batch_size}: median step off {median['off'] * 1e3:.2f} ms, "
                f"ring {median['ring'] / median['off']:.3f}x, timeline "
                f"{median['timeline'] / median['off']:.3f}x; a step's events alone: "
                f"{bound * 100:.3f} % of the step"
            )
    return 0
