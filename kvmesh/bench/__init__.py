"""Benchmarks that print JSON and a readable table (``kvmesh bench ...``)."""
