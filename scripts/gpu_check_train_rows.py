"""Issue 48's `hpcdl.train --decode gpu` goal as two input.jsonl rows (scripts/gpu-check-input.sh).

    python scripts/gpu_check_train_rows.py COMPUTE_LOG METRICS TRAIN_LOG OUT_JSONL WORKERS DEVICE

COMPUTE_LOG: the output of `python -m hpcdl.bench compute --json` for hpcdl's own step (its
last JSON line); METRICS and TRAIN_LOG: hpcdl.train's --metrics file and output, the same
model, precision and batch, fed by `--decode gpu` (the log's start line gives the slots).
Appends two rows with the issue's fields to OUT_JSONL: loader `none` (hpcdl's step alone, from
the compute bench) and loader `hpcdl.train` (images/s over the epochs after the first, the
data-wait share from the run's mean step), and prints their ratio.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path


def train_rows(
    compute: dict, metrics: list[dict], log: str, workers: int, device: str
) -> list[dict]:
    """The two rows; raises ValueError naming what is missing."""
    epochs = [r for r in metrics if r.get("event") == "epoch"]
    summary = next((r for r in reversed(metrics) if r.get("event") == "summary"), None)
    if not epochs or summary is None:
        raise ValueError("the metrics file holds no epoch or summary record")
    later = epochs[1:] or epochs
    images = sum(r["images_per_s"] * r["seconds"] for r in later)
    rate = images / sum(r["seconds"] for r in later)
    step = summary["mean_step"]
    common = dict(batch=summary["global_batch"] // summary["world_size"],
                  model=f"hpcdl {compute['model']}", precision=summary["precision"],
                  device=device)  # fmt: skip
    slots = re.search(r"(\d+) batch slots( \(auto\))?", log)
    if slots is None:
        raise ValueError("the run's output has no start line with its batch slots")
    alone = dict(loader="none", decode="-", workers=None, slots=None, slots_default=False,
                 images_per_s=compute["hpcdl_images_per_s"], data_wait_share=0.0,
                 **common)  # fmt: skip
    fed = dict(loader="hpcdl.train", decode="gpu", workers=workers, slots=int(slots[1]),
               slots_default=slots[2] is not None, images_per_s=rate,
               data_wait_share=step["t_data"] / step["t_step"], **common)  # fmt: skip
    return [alone, fed]


def main(argv: list[str]) -> int:
    from gpu_check_summary import last_json  # noqa: PLC0415  (beside this file in scripts/)

    compute_log, metrics_path, train_log, out, workers, device = argv
    try:
        compute = last_json(Path(compute_log))
        if compute is None:
            raise ValueError(f"no JSON line in {compute_log} (see it: the step alone failed)")
        text = Path(metrics_path).read_text()  # missing where the training run failed
        metrics = [json.loads(x) for x in text.splitlines() if x.strip()]
        rows = train_rows(compute, metrics, Path(train_log).read_text(), int(workers), device)
    except (OSError, ValueError, KeyError) as exc:  # a row it cannot make: said, not a traceback
        print(f"gpu_check_train_rows: no rows: {exc} ({metrics_path})", file=sys.stderr)
        return 1
    with open(out, "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    alone, fed = rows
    ratio = fed["images_per_s"] / alone["images_per_s"]
    print(f"hpcdl.train --decode gpu, {workers} workers: {fed['images_per_s']:.1f} images/s, "
          f"data wait {100 * fed['data_wait_share']:.1f} %; the step alone "
          f"{alone['images_per_s']:.1f} images/s: {ratio:.2f}x (goal >= 0.95)")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
