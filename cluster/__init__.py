"""Cluster level: the local launcher and the node client (router, Ray launcher and harness come next)."""
