"""Load generation: `bench serve` (serve_bench), its workloads (workloads, rag) and LoadSpec
(spec), which bench compare and bench sched drive."""
