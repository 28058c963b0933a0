"""The engine: requests, scheduling, KV blocks, sequences and outputs."""
