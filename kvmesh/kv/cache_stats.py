"""PrefixCacheStats: the counters of a serving prefix cache, shared by the radix index and the engine."""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(slots=True)
class PrefixCacheStats:
    requests: int = 0
    hits: int = 0  # lookups that reused at least min_prefix_length tokens
    misses: int = 0
    tokens_processed: int = 0  # prompt tokens looked up
    tokens_reused: int = 0  # ... of which came from the cache
    tokens_computed: int = 0  # ... of which had to be computed
    evictions: int = 0  # cached blocks that lost their hash (the pool counts them; the manager copies the count)

    def record_lookup(self, num_tokens: int, num_reused: int, min_prefix_length: int = 1) -> None:
        self.requests += 1
        if num_reused >= max(1, min_prefix_length):
            self.hits += 1
        else:
            self.misses += 1
        self.tokens_processed += num_tokens
        self.tokens_reused += num_reused
        self.tokens_computed += num_tokens - num_reused

    @property
    def hit_rate(self) -> float:
        return self.hits / self.requests if self.requests else 0.0

    @property
    def reuse_rate(self) -> float:
        return self.tokens_reused / self.tokens_processed if self.tokens_processed else 0.0

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "hit_rate": self.hit_rate, "reuse_rate": self.reuse_rate}

    def check_integrity(self) -> None:
        assert self.hits + self.misses == self.requests, "hits + misses != requests"
        assert self.tokens_reused + self.tokens_computed == self.tokens_processed, "reused + computed != processed"
