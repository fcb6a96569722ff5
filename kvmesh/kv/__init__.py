"""KV memory: the block-major buffer layout, chained block hashes, the block pool (allocation, references, LRU,
the hash map), eviction policies, and the lower tiers (host memory, disk) in ``tiers``."""
