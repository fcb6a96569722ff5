"""Torch reference implementations of every kernel: the CPU path and the oracle for Triton."""
