"""The block hash chain in C (a CPython extension without torch: nodes and routers); ``native`` loads it."""
