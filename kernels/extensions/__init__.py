"""CPython extensions (C, built on first use, no torch: routers load them too); ``loader`` builds and loads them.

``blake2b_chain.c``: the chained block hash; ``block_index.c``: the block pool's hash records.
"""
