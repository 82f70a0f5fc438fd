"""hpcdl: MPI-based data-parallel training with node-local staging."""

__version__ = "0.1.0"
