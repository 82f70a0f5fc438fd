"""Run /tmp/plan_old's hpcdl.stage (the code before issue 29) instead of the editable install."""

import runpy
import sys


def editable_hook(finder: object) -> bool:
    text = repr(finder).lower()
    return "skbc" in text or "editable" in text


sys.meta_path = [f for f in sys.meta_path if not editable_hook(f)]
sys.path.insert(0, "/tmp/plan_old")
sys.argv = ["hpcdl.stage", *sys.argv[1:]]
runpy.run_module("hpcdl.stage", run_name="__main__")
