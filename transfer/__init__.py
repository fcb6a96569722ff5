"""Moving KV blocks between nodes: transfer engines (Mooncake, ZMQ), the push protocol (holder, requester), grants
and their fences, landing slots, same-host shared memory, coalescing."""
