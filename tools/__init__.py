"""Developer tools of the hpcdl repository, above the package: they may import hpcdl, and hpcdl
never imports them (tests/test_layers.py holds both).

They are not installed: run them from the repository root (`python -m tools.bench NAME`), where
Python finds this directory; pytest finds it through pyproject.toml's `pythonpath`.
"""
