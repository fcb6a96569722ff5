"""Cluster metadata: the store (etcd with its credentials, in-memory), values sealed under the cluster key, embedded
etcd, node registry and directory, global block index, pins, mirrors."""
