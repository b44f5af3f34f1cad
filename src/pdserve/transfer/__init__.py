"""KV transfer from prefill (P) to decode (D) workers: the `wire` frame format and the
compression `codecs` it carries."""
