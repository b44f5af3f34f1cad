"""The deployment simulator (`pdserve sim`, `pdserve plan --simulate`).

`cluster.py` is the discrete-event loop over the engine's real scheduler and the router's real
planner; `steptime.py` prices steps and transfers (this host's cost model, or a GPU roofline
from `hardware.py`); `workload.py` makes request streams; `deploy.py` builds, runs, summarizes;
`search.py` is the planner's search.
"""
