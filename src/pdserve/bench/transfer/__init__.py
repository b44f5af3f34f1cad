"""`bench transfer`: KV transfer throughput, codecs and the TTFT breakdown (transfer_bench
measures, transfer_link is the two ends, transfer_report renders)."""
