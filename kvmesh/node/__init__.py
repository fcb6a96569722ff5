"""What prefill and decode nodes share: wire messages and the node runtime."""
