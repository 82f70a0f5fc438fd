"""The cluster model, one package: what a job of N nodes costs before it runs.

- calibration: the calibration file (four frozen tables; `load`, `save`), written by
  `python -m hpcdl.bench calibrate` and read by everything else here;
- equations: pure arithmetic, PFS load, staging, allreduce, the step, time to train of one job
  shape (`JobShape`, `NodeReads` -> `Prediction`);
- peers: the peer tier's term (issue 35): per epoch the PFS share of a node's new files and
  the seconds of its peer fetches, which equations adds to the staging of the PFS share;
- speed: the compute term, seconds per step = b / v0 + t, and its fit (held to t >= 0);
- prediction: the dry run's `predict(PredictionRequest)`, what every node reads from the
  staging plan and one `Prediction` per node count;
- comparison: predicted against measured, `python -m hpcdl.report --predicted`.
The equations are written out in docs/cluster-model.md.
"""
