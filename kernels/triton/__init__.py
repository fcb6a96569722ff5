"""Triton kernels (the CUDA path); each has a torch twin in ``kernels.reference``."""
