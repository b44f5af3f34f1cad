"""`pdserve serve` and `pdserve router`: one composition root, three fronts.

    flags.py  the command line's edge: flags (or --config YAML) -> `Deployment`
    plan.py   the composition root: Deployment -> worker specs, cost model, planner, router core
    local.py  worker processes on this machine (and `pdserve router` alone)
    ray.py    worker actors on Ray (`--ray`)
    http.py   the router core behind the OpenAI-compatible HTTP app (uvicorn); both fronts end here

`LocalCluster` (cluster.py) and `RayCluster` (ray/cluster.py) build the same router core for
programs and tests; the simulator takes the same `Deployment` (sim/deploy.py).
"""
