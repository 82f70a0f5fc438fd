"""bench compute with the Winograd path allowed on two chunk threads (measurement only)."""
import runpy, sys
from hpcdl.nn import conv
conv.WINOGRAD_THREADED_MIN_CHANNELS = conv.WINOGRAD_MIN_CHANNELS  # as on one thread
conv.WINOGRAD_THREADED_MIN_SIZE = 1
sys.argv = ["hpcdl.bench", *sys.argv[1:]]
runpy.run_module("hpcdl.bench", run_name="__main__", alter_sys=True)
