"""TensorBoard event files from the metrics records (`--tensorboard DIR`, rank 0 only).

The JSONL metrics (hpcdl.metrics.MetricsWriter) stay the one source: every record the writer
writes is also handed to `TensorBoardEvents.record`, which turns the numbers of `step` and
`epoch` records into scalar series (tensorboardX; the `tensorboard` extra). So the curves and
the JSONL of a run agree by construction, and a run without --metrics still gets its curves.

Series (docs/training.md), x axis the global step for `step` records and the epoch (1-based)
for `epoch` records:
- train/loss, train/lr, train/images_per_s (the step record's samples_per_s), and
  step_time/t_data, t_compute, t_comm_exposed, t_update, t_step (seconds);
  train/loss_scale under --precision fp16;
- epoch/loss, epoch/acc (training), epoch/val_loss, epoch/val_acc, epoch/images_per_s;
- staging/<node>/hits and staging/<node>/misses per node (the record's staging_nodes).
Events are flushed at least every FLUSH_S seconds and at every epoch, so TensorBoard shows a
run while it trains.
"""

from __future__ import annotations

from typing import Any

STEP_SERIES = {
    "loss": "train/loss",
    "lr": "train/lr",
    "samples_per_s": "train/images_per_s",
    "loss_scale": "train/loss_scale",
    "t_data": "step_time/t_data",
    "t_compute": "step_time/t_compute",
    "t_comm_exposed": "step_time/t_comm_exposed",
    "t_update": "step_time/t_update",
    "t_step": "step_time/t_step",
}
EPOCH_SERIES = {
    "loss": "epoch/loss",
    "acc": "epoch/acc",
    "val_loss": "epoch/val_loss",
    "val_acc": "epoch/val_acc",
    "images_per_s": "epoch/images_per_s",
}
FLUSH_S = 10


class TensorBoardEvents:
    """A tensorboardX SummaryWriter fed with metrics records."""

    def __init__(self, logdir: str) -> None:
        from tensorboardX import SummaryWriter  # noqa: PLC0415 (optional: the tensorboard extra)

        self.logdir = logdir
        self._writer = SummaryWriter(logdir, flush_secs=FLUSH_S)

    def record(self, event: str, fields: dict[str, Any]) -> None:
        """Add the scalars of one metrics record (other events carry no curves)."""
        if event == "step":
            self._scalars(STEP_SERIES, fields, int(fields["step"]))
        elif event == "epoch":
            epoch = int(fields["epoch"]) + 1
            self._scalars(EPOCH_SERIES, fields, epoch)
            for i, node in enumerate(fields.get("staging_nodes") or []):
                name = node.get("node", f"node{i}")
                for key in ("hits", "misses"):
                    self._writer.add_scalar(f"staging/{name}/{key}", node[key], epoch)
            self._writer.flush()

    def close(self) -> None:
        self._writer.close()

    def _scalars(self, series: dict[str, str], fields: dict[str, Any], step: int) -> None:
        for key, tag in series.items():
            value = fields.get(key)
            if value is not None:
                self._writer.add_scalar(tag, float(value), step)
