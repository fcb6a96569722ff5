"""KV memory: the block-major buffer layout (and, next, block hashes, pool and prefix caches)."""
