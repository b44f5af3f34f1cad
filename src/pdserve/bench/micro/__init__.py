"""Micro benchmarks of one engine: `bench engine` (MFU/MBU beside HF) and `bench codec` (KV
codec quality and speed)."""
