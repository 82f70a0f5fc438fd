"""`python -m hpcdl.doctor`: can hpcdl train here, and what should be fixed first?

Run alone, or under mpirun/srun with the job's layout: every rank probes MPI, GPUs, BLAS
threads, the stager and Slurm; the first rank of each node checks the stage directory; rank 0
prints one block per node (per rank where ranks differ) and every problem as one line with the
fix. Exit status: 0 nothing to fix, 1 warnings only (training runs, slower or less safely),
2 training cannot run as configured. docs/doctor.md describes each check.
"""
