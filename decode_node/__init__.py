"""The decode node: takes generate requests, gathers their KV (local, peers, prefill nodes), decodes, streams."""
