"""Request streams shared by the load generator (`pdserve bench serve`, bench/) and the simulator
(`pdserve sim`, sim/): what requests look like (streams.py), their knobs as one value (spec.py:
LoadSpec), and the knowledge-base QA workload over data/kb (rag.py). Imports nothing from bench/."""
