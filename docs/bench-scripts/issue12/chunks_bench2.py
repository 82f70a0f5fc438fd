"""hpcdl.bench compute with the choice use_layer_threads makes: BLAS 1 thread, conv chunks on the process's cores."""
import sys
from hpcdl import backend
from hpcdl.comm import blas_threads
print(blas_threads.use_layer_threads(backend.cpu_threads_hint()), file=sys.stderr)
from hpcdl.bench import compute
sys.exit(compute.main(sys.argv[1:]))
