"""Speculative decoding: prompt-lookup drafts (ngram.py), their verification by rejection
sampling (rejection.py) and the engine's use of both (decoder.py). docs/speculation.md."""
