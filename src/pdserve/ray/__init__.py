"""pdserve on Ray: place, supervise and scale the P and D pools on a Ray cluster.

Ray does placement and supervision only; the data planes (control messages, KV frames) stay
ZeroMQ between the router and the workers, as without Ray. `placement` and `scaling` are pure
(no Ray import: unit-tested without a cluster); `actor` runs one worker inside a Ray actor;
`pools` is the driver's side (start, watch, rejoin, resize; `pending` says why a worker waits);
`pdserve serve --ray` is serve/ray.py.
"""
