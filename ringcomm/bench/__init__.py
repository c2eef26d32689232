"""ringcomm's benchmarks: the collectives beside gloo, Open MPI and NCCL, with the memory floor and
the wire as limits (`python -m ringcomm.bench`, collectives.py), the kernels beside torch
(`python -m ringcomm.bench.kernels`), and the figures of both and of timelines (plot.py).
common.py holds what they share with each other and with the tests."""
