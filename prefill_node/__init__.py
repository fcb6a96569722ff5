"""The prefill node: computes prompts' KV, reusing local and cluster-wide prefixes, and serves it by hash."""
