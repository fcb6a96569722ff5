"""Cluster metadata: the store (etcd, in-memory), embedded etcd, node registry, global block index, mirror."""
