"""What prefill and decode nodes share: wire messages, the engine loop, cluster membership, measured rates and the
node runtime."""
