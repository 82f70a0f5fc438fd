"""Benchmarks: `python -m hpcdl.bench <name> ...`.

Each prints ratios to a baseline measured in the same run (docs/PERFORMANCE.md).
"""
