"""The HTTP front: the router core (serve/plan.py) behind the OpenAI-compatible app on uvicorn.

On Ctrl-C / SIGTERM uvicorn stops accepting, lets in-flight requests finish for up to the
deployment's `http.drain_s`, then returns; the caller (local.py, ray.py) stops the workers.
A router bound beyond loopback without an API key warns.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import signal
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

from pdserve.costmodel.model import CostModel
from pdserve.deployment import Deployment
from pdserve.engine import loader
from pdserve.router.core import RouterCore
from pdserve.serve.plan import log, router_core

# A background job of the front that runs beside the router (local.py's worker supervisor).
Watch = Callable[[RouterCore], Coroutine[Any, Any, None]]


async def serve_router(
    d: Deployment,
    endpoints: list[str],
    cost: CostModel | None = None,
    *,
    watch: Watch | None = None,
    pools: Any = None,
) -> int:
    """Serve the router in front of `endpoints` until a signal; `watch(core)` runs beside it;
    `pools` (pdserve.ray.pools.RayPools) supervises and resizes Ray worker actors."""
    from pdserve.metrics.prometheus import Metrics

    metrics = Metrics(slo_ttft_s=d.planner.slo_ttft_s, slo_tpot_s=d.planner.slo_tpot_s)
    level = cost_level(d)
    for kind in ("prefill", "decode"):
        metrics.cost_level.labels(kind).set(level.get(f"{kind}_x", 1.0))
    core = router_core(d, endpoints, cost, metrics=metrics)
    await core.start()
    if pools is not None:
        await pools.attach(core)
    watcher = asyncio.create_task(watch(core)) if watch is not None else None
    try:
        await _serve_app(d, core, metrics, pools, len(endpoints))
    finally:
        if watcher is not None:
            watcher.cancel()
        if pools is not None:
            await pools.close()
        await core.close()
    return 0


def cost_level(d: Deployment) -> dict[str, float]:
    """The level `--level-probe` saved with the cost model the planner uses ({} if none)."""
    if d.planner.cost_model in ("auto", "none"):
        return {}
    level = CostModel.load_about(Path(d.planner.cost_model)).get("level")
    return dict(level) if isinstance(level, dict) else {}


async def _serve_app(d: Deployment, core: RouterCore, metrics: Any, pools: Any, n: int) -> None:
    import uvicorn

    from pdserve.router.app import create_app

    source = loader.resolve_model(d.model or core.model or None)
    # off the event loop: a GGUF tokenizer takes seconds to build, and the heartbeats that
    # keep the workers in routing are answered on this loop
    tokenizer = await asyncio.to_thread(loader.load_tokenizer, source)
    arch = await asyncio.to_thread(loader.load_arch, source)
    http = d.http
    name = http.served_model_name or Path(source.path).name.removesuffix(".gguf")
    app = create_app(
        core,
        tokenizer,
        model_name=name,
        api_key=http.api_key,
        max_model_len=arch.max_position_embeddings,
        metrics=metrics,
        scaler=pools,
    )
    warn_if_exposed(http.host, http.api_key)
    config = uvicorn.Config(
        app,
        host=http.host,
        port=http.port,
        log_level="warning",
        timeout_graceful_shutdown=int(http.drain_s),
    )
    server = _server_class()(config)
    print(f"pdserve: serving {name} at http://{http.host}:{http.port}/v1 ({n} workers)", flush=True)
    await server.serve()


def _server_class() -> type:
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn re-raises SIGTERM after a graceful shutdown (exit status -15); a drained
        shutdown here is a success, so the signal only starts the drain."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, self.handle_exit, sig, None)
            try:
                yield
            finally:
                for sig in (signal.SIGINT, signal.SIGTERM):
                    loop.remove_signal_handler(sig)

    return Server


def warn_if_exposed(host: str, api_key: str | None) -> None:
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if not loopback and not api_key:
        log.warning(
            "the router listens on %s without --api-key: anyone who can reach it can use it", host
        )
