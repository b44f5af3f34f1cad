"""Which of a worker's stats (its `Stats` report, workers/worker.py `Worker.stats`) the router's
/metrics mirrors, under which `pdserve_*` name and help: prometheus.py's worker collector reads
these tables, labelling each series by worker and role."""

from __future__ import annotations

# Worker stats -> (metric suffix, help); gauges are the current value, counters cumulative.
WORKER_GAUGES = {
    "waiting": ("worker_queue_length", "Requests waiting in the worker's scheduler queue."),
    "running": ("worker_running", "Requests the worker is running."),
    "batch_requests": ("worker_batch_requests", "Requests in the worker's last engine step."),
    "batch_tokens": ("worker_batch_tokens", "Tokens computed in the worker's last engine step."),
    "threads": ("worker_threads", "Torch threads of the worker's engine steps (0: steps held)."),
    "kv_blocks_used": ("worker_kv_blocks_used", "KV cache blocks in use on the worker."),
    "kv_blocks_total": ("worker_kv_blocks_total", "KV cache blocks the worker has."),
    "kv_blocks_kept": (
        "worker_kv_blocks_kept",
        "KV blocks only kept conversation turns hold (released first when memory is needed).",
    ),
    "prefix_cache_hit_rate": (
        "worker_prefix_cache_hit_rate",
        "Fraction of prompt tokens found in the worker's prefix cache.",
    ),
    "gc_max_pause_seconds": (
        "worker_gc_max_pause_seconds",
        "The longest garbage-collection pause the worker has had.",
    ),
    "gc_frozen_objects": (
        "worker_gc_frozen_objects",
        "Start-up objects the worker froze out of the garbage collector's reach.",
    ),
    "prefill_probe_speedup": (
        "worker_prefill_probe_speedup",
        "Start-up probe: the decode format's time over bf16's on a prompt-sized projection.",
    ),
}
WORKER_COUNTERS = {
    "preemptions": ("worker_preemptions", "Requests the worker preempted."),
    "prefill_tokens": ("worker_prefill_tokens", "Prompt tokens computed (rate() = prefill tok/s)."),
    "decode_tokens": ("worker_decode_tokens", "Decode tokens computed (rate() = decode tok/s)."),
    "conversation_turns_kept": (
        "worker_conversation_turns_kept",
        "Finished conversation turns whose KV the worker kept for the next turn.",
    ),
    "conversation_hits": (
        "worker_conversation_hits",
        "Follow-up turns that arrived while their conversation's last turn was kept here.",
    ),
    "conversation_released_ttl": (
        "worker_conversation_released_ttl",
        "Kept conversation turns released at their TTL (--conversation-ttl).",
    ),
    "conversation_released_pressure": (
        "worker_conversation_released_pressure",
        "Kept conversation turns released early because memory was needed.",
    ),
    "lease_reclaims": ("worker_lease_reclaims", "KV holds a prefill worker reclaimed on expiry."),
    "transfer_failures": ("kv_transfer_failures", "KV hand-offs that failed on the worker."),
    "gc_collections": ("worker_gc_collections", "Python garbage collections in the worker."),
    "gc_full_collections": (
        "worker_gc_full_collections",
        "Full (generation 2) garbage collections in the worker: each stalls its main loop.",
    ),
    "gc_pause_seconds": (
        "worker_gc_pause_seconds",
        "Wall time the worker's main loop spent inside garbage collections.",
    ),
    "prompt_rows_prefill_format": (
        "worker_prompt_rows_prefill_format",
        "Prompt tokens whose projections ran on the prefill format (bf16).",
    ),
    "prompt_rows_decode_format": (
        "worker_prompt_rows_decode_format",
        "Prompt tokens left on the decode format (steps with too few prompt rows).",
    ),
    # speculation on decoding workers (engine/spec/, docs/speculation.md)
    "spec_draft_tokens": ("spec_draft_tokens", "Draft tokens verified (speculative decoding)."),
    "spec_accepted_tokens": ("spec_accepted_tokens", "Draft tokens accepted."),
    "spec_steps": (
        "spec_steps",
        "Request-steps that verified drafts (accepted / steps = "
        "accepted tokens per step beyond the one a step always yields).",
    ),
    "spec_disabled_steps": (
        "spec_disabled_steps",
        "Engine steps not drafted: the decode batch reached disable_by_batch_size.",
    ),
    "spec_paced_steps": (
        "spec_paced_steps",
        "Engine steps whose drafts per request were capped below num_speculative_tokens by "
        "the measured cost of verify rows and the acceptance rate (engine/spec/pacing.py).",
    ),
    "spec_grammar_skips": (
        "spec_grammar_skips",
        "Request-steps not drafted: the request has a grammar.",
    ),
    "spec_memory_skips": (
        "spec_memory_skips",
        "Decodes whose drafts found no free KV blocks (not verified).",
    ),
}
HANDOFF_STATS = {"handoffs_acked": "sent", "handoffs_received": "received"}
