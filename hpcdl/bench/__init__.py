"""Benchmarks: `python -m hpcdl.bench <name> ...`; each prints ratios to a baseline measured in the same run."""
