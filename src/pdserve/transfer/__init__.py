"""KV transfer from prefill (P) to decode (D) workers: the link's interface (`api`), its
transports (`transports`, `shm`, the in-memory `fake`), the `wire` frame format and the
compression `codecs` it carries."""
