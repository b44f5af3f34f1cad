"""One pdserve worker inside a Ray actor.

The actor builds the same `Worker` as `pdserve worker` (workers/worker.py) and runs its main loop
in a thread of the actor process; the router reaches it over ZeroMQ at the endpoints `info()`
returns. The worker binds the node's address (reachable from the router on another host), or
loopback when every process is on this machine (`--ray auto`). The shared secret arrives as a
constructor argument, so it is in no command line, environment or log; off loopback it is
required (workers/auth.py), as for `pdserve worker`.

When the worker dies, the actor process dies with it (`os._exit`), so Ray restarts the actor
(`max_restarts`), on this node or, if the node is gone, wherever its resources are free. The new
incarnation binds new ports; the driver (`pools.py`) sees a new `incarnation` and rejoins it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import uuid
from typing import Any

from pdserve.config import WorkerConfig
from pdserve.ray.placement import threads_for

log = logging.getLogger("pdserve.ray.actor")


class WorkerActor:
    """Made a Ray actor class by `pools.actor_class()` (keeps `import ray` lazy)."""

    def __init__(
        self,
        role: str,
        worker_id: str,
        engine_args: dict[str, Any],
        config: dict[str, Any],
        secret: bytes | None,
        loopback: bool,
    ) -> None:
        import ray
        import zmq

        from pdserve.workers import auth
        from pdserve.workers import messages as m
        from pdserve.workers.worker import Worker

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
        ctx = ray.get_runtime_context()
        host = "127.0.0.1" if loopback else ray.util.get_node_ip_address()
        auth.require_secret([host], secret)
        m.set_key(secret)
        engine = dict(engine_args)
        if engine.get("threads") is None:
            assigned = ctx.get_assigned_resources()
            engine["threads"] = threads_for(assigned)
            if assigned.get("CPU", 1) < 1:  # an honest thread count cannot be below one
                log.info("worker %s holds %g CPUs: 1 torch thread, sharing a core",
                         worker_id, assigned.get("CPU"))  # fmt: skip
        cfg = dataclasses.replace(WorkerConfig(**config), host=host, port=0, kv_port=0)
        self.node_id = ctx.get_node_id()
        self.incarnation = uuid.uuid4().hex
        self.stopping = False
        self.worker = Worker(role, engine, worker_id=worker_id, config=cfg, ctx=zmq.Context())
        self.worker.gc_pauses.freeze_startup_heap()  # this process holds one worker
        self.thread = threading.Thread(target=self._serve, name=f"worker-{worker_id}", daemon=True)
        self.thread.start()
        log.info("worker %s (%s) on node %s at %s", worker_id, role, self.node_id[:8], host)

    def _serve(self) -> None:
        try:
            self.worker.serve_forever()
        except BaseException:
            log.exception("worker %s failed", self.worker.worker_id)
        if not self.stopping:  # the worker is gone but the actor is not: let Ray restart both
            os._exit(1)

    def info(self) -> dict[str, Any]:
        """The worker's endpoints, where it runs, and which incarnation of the actor this is."""
        w = self.worker
        return {
            "worker_id": w.worker_id,
            "role": w.role,
            "control": w.control_endpoint,
            "kv": w.kv_endpoint,
            "node_id": self.node_id,
            "pid": os.getpid(),
            "threads": w.engine.config.parallel_config.threads,
            "incarnation": self.incarnation,
            "alive": self.thread.is_alive(),
        }

    def shutdown(self, timeout_s: float = 10.0) -> bool:
        """Stop the worker's loop (it closes its sockets); True when it ended in time."""
        self.stopping = True
        self.worker.running = False
        self.thread.join(timeout_s)
        return not self.thread.is_alive()
