"""Run a module or script against /tmp/chunks-before: drop the editable-install import hook."""
import runpy, sys
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in (type(f).__module__ + type(f).__name__).lower()]
sys.path.insert(0, "/tmp/chunks-before")
import hpcdl; assert hpcdl.__file__.startswith("/tmp/chunks-before"), hpcdl.__file__
print("before:", hpcdl.__file__, file=sys.stderr)
target = sys.argv[1]; sys.argv = sys.argv[1:]
if target == "-m":
    sys.argv = sys.argv[1:]; runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
else:
    runpy.run_path(target, run_name="__main__")
