"""Moving KV blocks between nodes: transfer engines (Mooncake, ZMQ), the push protocol, coalescing."""
