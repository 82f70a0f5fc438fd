"""MPI communicators, CUDA-awareness detection and gradient reduction over flat buffers.

Nothing here knows about layers or models: it reduces contiguous buffers.
"""
