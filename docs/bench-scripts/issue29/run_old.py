"""Run /tmp/plan_old's hpcdl (the code before issue 29's planner) instead of the editable install."""
import runpy, sys
sys.meta_path = [f for f in sys.meta_path if "skbc" not in repr(f).lower() and "editable" not in repr(f).lower()]
sys.path.insert(0, "/tmp/plan_old")
sys.argv = ["hpcdl.stage", *sys.argv[1:]]
runpy.run_module("hpcdl.stage", run_name="__main__")
