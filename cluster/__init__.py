"""Cluster level: node processes and their launchers (local, simulated hosts, Ray), supervision, the router with its
routing policies, the gRPC and OpenAI HTTP front ends, API keys, and the node client."""
