"""Benchmarks run by `pdserve bench ...`; heavy imports stay inside the functions using them."""
