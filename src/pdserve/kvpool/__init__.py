"""Tiered KV pool (issue 15): host memory, local disk and Redis, keyed by chained block hashes."""
