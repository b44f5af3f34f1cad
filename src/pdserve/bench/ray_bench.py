"""pdserve on Ray against the built-in launcher: start-up, per-request overhead, replacing a
lost node's workers, and a scale-out under rising load.

`python -m pdserve.bench.ray_bench [--model PATH] [--part startup|recovery|scale|all]`:

- startup: `pdserve serve --prefill 1 --decode 1 --threads 1` with and without `--ray auto`,
  alternated; seconds from the command to the first completed token over HTTP; then the same
  server answers `--requests` sequential streamed requests (TTFT and end-to-end medians): the
  data plane is the same ZeroMQ one, so the per-request numbers should match.
- recovery (ray.cluster_utils.Cluster: head with no CPUs, a node with pdserve_prefill, one with
  pdserve_decode): a D worker process killed (Ray restarts the actor on its node), and the D node
  removed with a replacement node added at once (Ray restarts the actor there): seconds until
  the router routes to D again; requests in flight during the loss are counted (none may fail).
- scale: the same cluster; Poisson load at rising rates on 1P + 1D, then `resize(decode=2)`
  (what POST /admin/pools does) and the top rate again; goodput = requests/s within both SLOs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import signal
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from pdserve.bench.harness import report
from pdserve.hostinfo import cpu_model

SECRET = b"bench-secret-0123456789abcdef0123"


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    p.add_argument("--part", choices=("startup", "recovery", "scale", "all"), default="all")
    p.add_argument("--repeats", type=int, default=2, help="start-ups per arm")
    p.add_argument("--requests", type=int, default=20, help="sequential requests per server")
    p.add_argument("--rates", default="1,2,4", help="scale: request rates (1/s), rising")
    p.add_argument("--per-rate", type=int, default=24, help="scale: requests per rate")
    p.add_argument("--slo-ttft", type=float, default=1.0)
    p.add_argument("--slo-tpot", type=float, default=0.1)
    p.add_argument("--max-num-seqs", type=int, default=4, help="scale: each D's running cap")
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args(argv)


# ---- startup and per-request overhead, over HTTP -------------------------------------------------
def _post(port: int, body: dict[str, Any], timeout: float = 60) -> Any:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    return urllib.request.urlopen(req, timeout=timeout)


def _first_token_s(port: int, t0: float, proc: subprocess.Popen) -> float:
    while proc.poll() is None:
        try:
            _post(port, {"model": "m", "prompt": "Hi", "max_tokens": 1}, 10).read()
            return time.monotonic() - t0
        except urllib.error.HTTPError:
            raise  # the server answered with an error: a bug here, not a slow start
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"the server exited with {proc.returncode}")


def _streamed(port: int, prompt: str, max_tokens: int) -> tuple[float, float]:
    """(TTFT, end-to-end) seconds of one streamed request."""
    t0 = time.monotonic()
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    body |= {"temperature": 0, "ignore_eos": True}
    first = None
    with _post(port, body) as r:
        for line in r:
            if line.startswith(b"data: {") and first is None:
                first = time.monotonic() - t0
    assert first is not None
    return first, time.monotonic() - t0


def startup(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    arms = [("built-in launcher", []), ("--ray auto", ["--ray", "auto"])]
    for rep in range(args.repeats):
        for name, extra in arms:
            port = 18400 + rep * 2 + len(extra) // 2
            cmd = [
                sys.executable,
                "-m",
                "pdserve.cli",
                "serve",
                *([args.model] if args.model else []),
            ]
            cmd += ["--prefill", "1", "--decode", "1", "--threads", "1", "--port", str(port)]
            cmd += ["--cost-model", "none", "--served-model-name", "m", *extra]
            t0 = time.monotonic()
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                ttft0 = _first_token_s(port, t0, proc)
                samples = [
                    _streamed(port, f"Question {i}: explain the number {i} in detail.", 16)
                    for i in range(args.requests)
                ]
            finally:
                proc.send_signal(signal.SIGTERM)
                proc.wait(120)
            rows.append(
                {
                    "arm": name,
                    "startup_to_first_token_s": round(ttft0, 2),
                    "ttft_ms_p50": round(1000 * statistics.median(s[0] for s in samples), 1),
                    "e2e_ms_p50": round(1000 * statistics.median(s[1] for s in samples), 1),
                }
            )
            print(rows[-1], flush=True)
    return rows


# ---- a multi-node cluster on this machine --------------------------------------------------------
class Nodes:
    def __init__(self) -> None:
        import ray
        from ray.cluster_utils import Cluster

        os.environ["RAY_memory_monitor_refresh_ms"] = "0"  # noqa: SIM112 (Ray's spelling)
        fast = {"health_check_initial_delay_ms": 1000, "health_check_period_ms": 1000}
        fast["health_check_failure_threshold"] = 3
        self.cluster = Cluster(
            initialize_head=True,
            head_node_args={"num_cpus": 0, "include_dashboard": False, "_system_config": fast,
                            "object_store_memory": 100 << 20},
        )  # fmt: skip
        self.prefill = self.cluster.add_node(
            num_cpus=1, resources={"pdserve_prefill": 1}, object_store_memory=100 << 20
        )
        self.decode = self.add_decode()
        ray.init(address=self.cluster.address, logging_level=logging.WARNING, log_to_driver=False)
        self.cluster.wait_for_nodes()

    def add_decode(self) -> Any:
        return self.cluster.add_node(
            num_cpus=2, resources={"pdserve_decode": 2}, object_store_memory=100 << 20
        )

    def close(self) -> None:
        import ray

        ray.shutdown()
        self.cluster.shutdown()


def _ray_cluster(args: argparse.Namespace, **engine: Any) -> Any:
    from pdserve.ray.cluster import RayCluster
    from pdserve.ray.pools import PoolSpec

    spec = PoolSpec(engine_args={"model": args.model, "kv_cache_memory_gb": 0.2, **engine})
    return RayCluster(args.model, spec=spec, secret=SECRET)


def _until(cond: Any, timeout_s: float = 300) -> float:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError
        time.sleep(0.05)
    return time.monotonic() - t0


def _d_up(c: Any) -> bool:
    return any(r["role"] == "decode" and r["healthy"] for r in c.table())


def recovery(args: argparse.Namespace, nodes: Nodes) -> list[dict[str, Any]]:
    from pdserve.engine.request import SamplingParams

    rows = []
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    prompts = [f"Tell me about {i}." for i in range(8)]
    with _ray_cluster(args) as c:
        for case in ("process killed", "node lost, a new one added"):
            _, job = c.submit(prompts, params)
            _until(lambda: c.stats["route_remote"] > 0 or c.stats["kv_recv_bytes"] > 0, 60)
            row = next(r for r in c.table() if r["id"] == "D0")
            t0 = time.monotonic()
            if case == "process killed":
                os.kill(row["pid"], signal.SIGKILL)
            else:
                nodes.cluster.remove_node(nodes.decode)
                nodes.decode = nodes.add_decode()  # the replacement machine
            down = _until(lambda: not _d_up(c), 60)
            back = _until(lambda: _d_up(c), 300)
            outs = job.result(300)
            rows.append(
                {
                    "case": case,
                    "router_noticed_s": round(down, 2),
                    "d_back_in_routing_s": round(time.monotonic() - t0, 2),
                    "down_time_s": round(back, 2),
                    "requests": len(outs),
                    "failed": sum(o.error is not None for o in outs),
                }
            )
            print(rows[-1], flush=True)
    return rows


async def _poisson(c: Any, n: int, rate: float, seed: int) -> list[Any]:
    from pdserve.engine.request import SamplingParams

    rng = random.Random(seed)
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    jobs = []
    for i in range(n):
        prompt = f"Request {seed}-{i}: " + "tell me more about this topic. " * rng.randint(2, 8)
        jobs.append(asyncio.ensure_future(c._one(f"s{seed}-{i}", prompt, params)))
        await asyncio.sleep(rng.expovariate(rate))
    return list(await asyncio.gather(*jobs))


def _goodput(outs: list[Any], args: argparse.Namespace) -> dict[str, Any]:
    ok, ttfts, tpots = 0, [], []
    start = min(o.metrics.arrival_time for o in outs)
    end = max(o.metrics.finished_time for o in outs)
    for o in outs:
        mt, n = o.metrics, len(o.outputs[0].token_ids)
        if o.error is not None or mt.first_token_time is None:
            continue
        ttft = mt.first_token_time - mt.arrival_time
        tpot = (mt.finished_time - mt.first_token_time) / max(1, n - 1)
        ttfts.append(ttft)
        tpots.append(tpot)
        ok += ttft <= args.slo_ttft and tpot <= args.slo_tpot
    return {
        "requests": len(outs),
        "failed": sum(o.error is not None for o in outs),
        "ttft_p50_s": round(statistics.median(ttfts), 3),
        "tpot_p50_ms": round(1000 * statistics.median(tpots), 1),
        "within_slo": ok,
        "goodput_rps": round(ok / (end - start), 2),
    }


def scale(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    rates = [float(r) for r in args.rates.split(",")]
    with _ray_cluster(args, max_num_seqs=args.max_num_seqs) as c:
        c.generate(["warm up"], None)
        for i, rate in enumerate(rates):
            outs = c._run(_poisson(c, args.per_rate, rate, i), 600)
            rows.append({"decode_workers": 1, "rate": rate, **_goodput(outs, args)})
            print(rows[-1], flush=True)
        t0 = time.monotonic()
        c.resize({"decode": 2})
        _until(lambda: sum(r["role"] == "decode" and r["healthy"] for r in c.table()) == 2)
        joined = round(time.monotonic() - t0, 2)
        outs = c._run(_poisson(c, args.per_rate, rates[-1], len(rates)), 600)
        rows.append({"decode_workers": 2, "rate": rates[-1], "joined_s": joined,
                     **_goodput(outs, args)})  # fmt: skip
        print(rows[-1], flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    head = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "load_average_before": [round(x, 2) for x in report.load_average()],
        "command": report.command_line(argv, "python -m pdserve.bench.ray_bench"),
    }
    out: dict[str, Any] = {"head": head}
    if args.part in ("startup", "all"):
        out["startup"] = startup(args)
    if args.part in ("recovery", "scale", "all"):
        nodes = Nodes()
        try:
            if args.part in ("recovery", "all"):
                out["recovery"] = recovery(args, nodes)
            if args.part in ("scale", "all"):
                out["scale"] = scale(args)
        finally:
            nodes.close()
    head["load_average_after"] = [round(x, 2) for x in report.load_average()]
    print(json.dumps(out, indent=2))
    if args.json:
        report.write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
