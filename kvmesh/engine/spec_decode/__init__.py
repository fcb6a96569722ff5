"""Speculative decoding: proposers, the rejection sampler, the engine-side speculator."""
