"""Issue 48's `hpcdl.train --decode gpu` goal as two input.jsonl rows (scripts/gpu-check-input.sh).

    python scripts/gpu_check_train_rows.py COMPUTE_LOG METRICS TRAIN_LOG OUT_JSONL WORKERS DEVICE
    python scripts/gpu_check_train_rows.py --alone-input INPUT_JSONL METRICS TRAIN_LOG OUT_JSONL \
        WORKERS

COMPUTE_LOG: the output of `python -m hpcdl.bench compute --json` for hpcdl's own step (its
last JSON line); METRICS and TRAIN_LOG: hpcdl.train's --metrics file and output, the same
model, precision and batch, fed by `--decode gpu` (the log's start line gives the slots).
Appends two rows with the issue's fields to OUT_JSONL: loader `none` (hpcdl's step alone, from
the compute bench) and loader `hpcdl.train` (images/s over the steps after the first 6, from
the step records, as `bench input` times its rows; without step records, over the epochs after
the first; the data-wait share from the run's mean step), and prints their ratio.

With --alone-input (issue 61: hpcdl.train with a torch model, torchvision's resnet50): the step
alone is the input phase's (INPUT_JSONL's last `none` row of a torch model, torchvision's step
on the same folder, batch and crops; not hpcdl's own step's row), and only the `hpcdl.train`
row is appended, under that row's model and device, so the summary sets the two side by side.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

# as `hpcdl.bench input` times its rows: the steps after 6, one epoch boundary among them
# (gpu-check-input.sh runs 56 steps of 50 an epoch, --metrics-every 1)
WARMUP_STEPS = 6


def train_rows(
    compute: dict, metrics: list[dict], log: str, workers: int, device: str
) -> list[dict]:
    """The two rows; raises ValueError naming what is missing."""
    model = f"hpcdl {compute['model']}" + (" --gpu-kernels" if compute.get("gpu_kernels") else "")
    fed = fed_row(metrics, log, workers, device, model)
    alone = dict(loader="none", decode="-", workers=None, slots=None, slots_default=False,
                 images_per_s=compute["hpcdl_images_per_s"], data_wait_share=0.0,
                 batch=fed["batch"], model=model, precision=fed["precision"],
                 device=device)  # fmt: skip
    return [alone, fed]


def fed_row(metrics: list[dict], log: str, workers: int, device: str, model: str) -> dict:
    """The `hpcdl.train` row of a --decode gpu run; raises ValueError naming what is missing."""
    epochs = [r for r in metrics if r.get("event") == "epoch"]
    summary = next((r for r in reversed(metrics) if r.get("event") == "summary"), None)
    if not epochs or summary is None:
        raise ValueError("the metrics file holds no epoch or summary record")
    window = steps_window(metrics, summary["global_batch"])
    if window is not None:
        rate = window[0]
    else:  # no step records: the epochs after the first
        later = epochs[1:] or epochs
        images = sum(r["images_per_s"] * r["seconds"] for r in later)
        rate = images / sum(r["seconds"] for r in later)
    step = summary["mean_step"]
    slots = re.search(r"(\d+) batch slots( \(auto\))?", log)
    if slots is None:
        raise ValueError("the run's output has no start line with its batch slots")
    return dict(loader="hpcdl.train", decode="gpu", workers=workers, slots=int(slots[1]),
                slots_default=slots[2] is not None, images_per_s=rate,
                data_wait_share=step["t_data"] / step["t_step"],
                batch=summary["global_batch"] // summary["world_size"], model=model,
                precision=summary["precision"], device=device)  # fmt: skip


def steps_window(metrics: list[dict], global_batch: int) -> tuple[float, int, int] | None:
    """(images/s, first step, last step) over the steps after the first WARMUP_STEPS, from the
    step records (each `time` the end of its step: the window runs from the end of the record
    at or after WARMUP_STEPS to the last), or None where fewer than two such records exist."""
    after = [r for r in metrics if r.get("event") == "step" and "time" in r
             and r["step"] >= WARMUP_STEPS]  # fmt: skip
    if len(after) < 2 or after[-1]["time"] <= after[0]["time"]:
        return None
    steps = after[-1]["step"] - after[0]["step"]
    rate = steps * global_batch / (after[-1]["time"] - after[0]["time"])
    return rate, after[0]["step"] + 1, after[-1]["step"]


def step_alone(input_jsonl: Path) -> dict:
    """The input phase's last `none` row of a torch model (the step alone of `hpcdl.bench
    input`, not hpcdl's own: "hpcdl MODEL"); ValueError where there is none."""
    rows = [json.loads(x) for x in input_jsonl.read_text().splitlines() if x.strip()]
    alone = [r for r in rows if r.get("loader") == "none"]
    alone = [r for r in alone if not str(r.get("model")).startswith("hpcdl ")]
    if not alone:
        raise ValueError(f"{input_jsonl} has no step-alone row (loader none)")
    return alone[-1]


def main(argv: list[str]) -> int:
    against_input = argv[0] == "--alone-input"
    source, metrics_path, train_log, out, workers, *device = argv[1:] if against_input else argv
    try:
        text = Path(metrics_path).read_text()  # missing where the training run failed
        metrics = [json.loads(x) for x in text.splitlines() if x.strip()]
        log = Path(train_log).read_text()
        if against_input:
            alone = step_alone(Path(source))
            rows = [fed_row(metrics, log, int(workers), alone["device"], alone["model"])]
        else:
            from gpu_check_summary import last_json  # noqa: PLC0415  (beside it in scripts/)

            compute = last_json(Path(source))
            if compute is None:
                raise ValueError(f"no JSON line in {source} (see it: the step alone failed)")
            rows = train_rows(compute, metrics, log, int(workers), device[0])
            alone = rows[0]
    except (OSError, ValueError, KeyError) as exc:  # a row it cannot make: said, not a traceback
        print(f"gpu_check_train_rows: no rows: {exc} ({metrics_path})", file=sys.stderr)
        return 1
    with open(out, "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    fed = rows[-1]
    ratio = fed["images_per_s"] / alone["images_per_s"]
    wait = 100 * fed["data_wait_share"]
    print(f"hpcdl.train --decode gpu ({fed['model']}), {workers} workers: "
          f"{fed['images_per_s']:.1f} images/s, data wait {wait:.1f} %; the step alone "
          f"{alone['images_per_s']:.1f} images/s: {ratio:.2f}x (goal >= 0.95)")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
