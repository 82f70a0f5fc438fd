"""Run `python -m hpcdl.bench ...` from a base checkout unpacked in /tmp/hh_base
(`git archive d47b063 hpcdl | tar -x -C /tmp/hh_base`), not from the editable install."""
import runpy, sys
sys.meta_path = [f for f in sys.meta_path if "skbc" not in type(f).__module__]
sys.path.insert(0, "/tmp/hh_base")
import hpcdl
assert hpcdl.__file__.startswith("/tmp/hh_base"), hpcdl.__file__
sys.argv = ["hpcdl.bench", *sys.argv[1:]]
runpy.run_module("hpcdl.bench", run_name="__main__")
