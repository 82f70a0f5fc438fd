"""`python -m hpcdl.bench ...` from the checkout named first (an A/B of two commits).

The editable install's finder is dropped: else it imports the installed checkout whatever
PYTHONPATH says.
"""

import runpy
import sys

root = sys.argv.pop(1)
sys.meta_path = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
sys.path.insert(0, root)
import hpcdl.nn.dtypes  # noqa: E402

assert hpcdl.nn.dtypes.__file__.startswith(root), hpcdl.nn.dtypes.__file__
sys.argv[0] = "hpcdl.bench"
runpy.run_module("hpcdl.bench", run_name="__main__", alter_sys=True)
