"""P and D on two "hosts": each worker in its own network namespace, tcp between them over veth.

Topology (made here when run as root, as CI is; names and subnet carry this process's pid):

    root namespace: test process (RouterCore)  bridge pdbr<pid> 10.77.N.1/24
        |-- veth pdpr<pid> ==== pdpn<pid> 10.77.N.2  namespace pdserve-p-<pid>: prefill worker
        `-- veth pddr<pid> ==== pddn<pid> 10.77.N.3  namespace pdserve-d-<pid>: decode worker

The router reaches both control sockets through the bridge; P reaches D's KV endpoint the same
way (bridged, so no ip_forward change). Impairments go on the egress of all four veth ends, so
every path (router<->P, router<->D, P<->D) sees them in both directions:

  * `tc netem delay 30ms 10ms loss 2%` where the kernel has sch_netem;
  * otherwise (this project's machines and CI run a kernel without sch_netem, sch_prio or
    act_gact) the same loss from what it does have: a classic-BPF classifier that matches a
    random 2% of IPv4 packets (`ld rand`) with `mirred redirect` to a veth that is down, which
    drops them; and, for delay, a tbf rate limit of 1 Mbit/s (serialisation and queueing delay:
    the long prompt's KV takes ~0.3 s to cross), not a fixed latency.

A cut of the P->D link is a u32 filter on P's egress matching D's address, redirected to the
down veth: only P->D packets vanish, so the router still hears both workers (a worker whose
heartbeat dies would be taken out of routing, which is test_recovery's business, not this one).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass, field

import pytest
import torch

from factories import eventually
from pdserve import LLM, SamplingParams
from pdserve.cluster import LocalCluster, WorkerHandle
from pdserve.launcher import Launched, WorkerSpec, worker_command
from pdserve.workers import auth
from pdserve.workers import messages as m

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
DEADLINE_S = 2.0  # worker deadline: silence on a hand-off longer than this fails it
LEASE_S = 4.0
REQUEST_BOUND_S = 3 * DEADLINE_S + 5  # a request's whole life, retry included, fits in this
DEADLINE_RE = re.compile(r"(did not reserve KV blocks within|no progress on KV \w+ for) 2s")

pytestmark = pytest.mark.skipif(
    not hasattr(os, "geteuid")
    or os.geteuid() != 0
    or shutil.which("ip") is None
    or shutil.which("tc") is None,
    reason="network namespaces need root and iproute2 (ip, tc)",
)


def _prompts() -> list[str | list[int]]:
    g = torch.Generator().manual_seed(7)
    long = torch.randint(3, 49000, (70,), generator=g).tolist()  # several KV frames per layer
    return ["Hi", "The quick brown fox jumps over the lazy dog", long, [17]]


# ---- the namespaces ----------------------------------------------------------------------------
def _sh(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = ["ip", "netns", "exec", ns, *args] if ns else list(args)
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if check and res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({res.returncode}): {res.stderr.strip()}")
    return res


def _rand_match(p: float) -> str:
    """Classic BPF for cls_bpf: match (return -1) a random fraction p of packets, else 0."""
    threshold = int(p * (1 << 32))
    return f"4,32 0 0 {(-4096 + 56) & 0xFFFFFFFF},53 0 1 {threshold},6 0 0 0,6 0 0 4294967295"


@dataclass
class Net:
    tag: str
    subnet: str  # "10.77.N"
    ns: dict[str, str]  # role -> namespace
    addr: dict[str, str]  # role -> address of the worker's interface
    links: list[tuple[str | None, str]] = field(default_factory=list)  # (ns or None=root, dev)
    sinks: dict[str | None, str] = field(default_factory=dict)  # ns -> down veth (drops)
    netem: bool = False

    @property
    def bridge(self) -> str:
        return f"pdbr{self.tag}"

    def tc(self, ns: str | None, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return _sh("tc", *args, ns=ns, check=check)

    def impair(self, delay_ms: int = 30, jitter_ms: int = 10, loss: float = 0.02) -> None:
        for ns, dev in self.links:
            if self.netem:
                self.tc(ns, "qdisc", "replace", "dev", dev, "root", "netem", "delay",
                        f"{delay_ms}ms", f"{jitter_ms}ms", "loss", f"{loss * 100:g}%")  # fmt: skip
                continue
            self.tc(ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", "1mbit",
                    "burst", "16kb", "latency", "1s")  # fmt: skip
            self.tc(ns, "qdisc", "replace", "dev", dev, "clsact")
            self.tc(ns, "filter", "add", "dev", dev, "egress", "protocol", "ip", "pref", "20",
                    "bpf", "bytecode", _rand_match(loss),
                    "action", "mirred", "egress", "redirect", "dev", self.sinks[ns])  # fmt: skip

    def cut(self, src: str, dst: str) -> None:
        """Drop every packet from `src`'s worker to `dst`'s (one direction, nothing else)."""
        ns = self.ns[src]
        dev = next(d for n, d in self.links if n == ns)
        self.tc(ns, "qdisc", "replace", "dev", dev, "clsact")
        self.tc(ns, "filter", "add", "dev", dev, "egress", "protocol", "ip", "pref", "1",
                "u32", "match", "ip", "dst", f"{self.addr[dst]}/32",
                "action", "mirred", "egress", "redirect", "dev", self.sinks[ns])  # fmt: skip

    def heal(self) -> None:
        for ns, dev in self.links:
            self.tc(ns, "qdisc", "del", "dev", dev, "root", check=False)
            self.tc(ns, "qdisc", "del", "dev", dev, "clsact", check=False)

    def dropped(self) -> int:
        """Packets the loss/cut filters or netem dropped so far, over all links."""
        total = 0
        for ns, dev in self.links:
            out = self.tc(ns, "-s", "filter", "show", "dev", dev, "egress", check=False).stdout
            total += sum(int(n) for n in re.findall(r"overlimits (\d+)", out))
            if self.netem:
                out = self.tc(ns, "-s", "qdisc", "show", "dev", dev, check=False).stdout
                total += sum(int(n) for n in re.findall(r"dropped (\d+)", out))
        return total

    def retransmits(self) -> int:
        """TCP segments retransmitted by the workers' namespaces and the router's (root)."""
        total = 0
        for ns in [*self.ns.values(), None]:
            lines = [ln.split() for ln in _sh("cat", "/proc/net/snmp", ns=ns).stdout.splitlines()]
            head, vals = [ln for ln in lines if ln and ln[0] == "Tcp:"][:2]
            total += int(vals[head.index("RetransSegs")])
        return total

    def unsent(self, src: str, dst: str) -> int:
        """Bytes queued on `src`'s TCP connections to `dst` that the peer has not acknowledged."""
        out = _sh("ss", "-tnH", "dst", self.addr[dst], ns=self.ns[src], check=False).stdout
        return sum(int(ln.split()[2]) for ln in out.splitlines() if len(ln.split()) >= 5)


def _free_subnet(pid: int) -> str:
    routes = _sh("ip", "-4", "route", "show").stdout
    for i in range(254):
        third = 1 + (pid + i) % 254
        if f"10.77.{third}." not in routes:
            return f"10.77.{third}"
    pytest.skip("no free 10.77.N.0/24 subnet for the test namespaces")


def _make_net() -> Net:
    pid = os.getpid()
    tag = str(pid)
    net = Net(tag, _free_subnet(pid),
              {"prefill": f"pdserve-p-{tag}", "decode": f"pdserve-d-{tag}"}, {})  # fmt: skip
    try:
        _sh("ip", "netns", "add", net.ns["prefill"])
    except RuntimeError as e:
        pytest.skip(f"cannot create a network namespace here: {e}")
    try:
        _sh("ip", "netns", "add", net.ns["decode"])
        _sh("ip", "link", "add", net.bridge, "type", "bridge")
        _sh("ip", "addr", "add", f"{net.subnet}.1/24", "dev", net.bridge)
        _sh("ip", "link", "set", net.bridge, "up")
        for host, (role, ns) in enumerate(net.ns.items(), start=2):
            root_end, ns_end = f"pd{role[0]}r{tag}", f"pd{role[0]}n{tag}"
            _sh("ip", "link", "add", root_end, "type", "veth", "peer", "name", ns_end,
                "netns", ns)  # fmt: skip
            _sh("ip", "link", "set", root_end, "master", net.bridge, "up")
            net.addr[role] = f"{net.subnet}.{host}"
            _sh("ip", "-n", ns, "addr", "add", f"{net.addr[role]}/24", "dev", ns_end)
            _sh("ip", "-n", ns, "link", "set", ns_end, "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
            net.links += [(None, root_end), (ns, ns_end)]
            # a veth left down: mirred redirects to it drop the packet
            _sh("ip", "-n", ns, "link", "add", f"pdsk{tag}", "type", "veth", "peer", "name",
                f"pdsl{tag}")  # fmt: skip
            net.sinks[ns] = f"pdsk{tag}"
        _sh("ip", "link", "add", f"pdsk{tag}", "type", "veth", "peer", "name", f"pdsl{tag}")
        net.sinks[None] = f"pdsk{tag}"
        # netem where the kernel has it; the fallback's pieces (clsact, cls_bpf, u32, mirred,
        # tbf) are probed by the tests that use them, which fail loudly if one is missing
        probe = net.tc(None, "qdisc", "add", "dev", net.links[0][1], "root", "netem",
                       "delay", "1ms", check=False)  # fmt: skip
        net.netem = probe.returncode == 0
        net.heal()
    except BaseException:
        _teardown(net)
        raise
    return net


def _teardown(net: Net) -> None:
    for ns in net.ns.values():  # whatever still runs in our namespaces was started by us
        pids = _sh("ip", "netns", "pids", ns, check=False).stdout.split()
        for p in pids:
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(p), 9)
    for dev in (net.bridge, f"pdpr{net.tag}", f"pddr{net.tag}", f"pdsk{net.tag}"):
        _sh("ip", "link", "del", dev, check=False)
    for ns in net.ns.values():
        _sh("ip", "netns", "del", ns, check=False)


@pytest.fixture(scope="module")
def net():  # type: ignore[no-untyped-def]
    n = _make_net()
    try:
        yield n
    finally:
        _teardown(n)


# ---- the cluster ---------------------------------------------------------------------------------
class NetnsCluster(LocalCluster):
    """LocalCluster whose workers run in the namespaces of `net`, bound to their addresses."""

    def __init__(self, model: str, net: Net, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(model, prefill=1, decode=1, transport="tcp", **kwargs)
        self.net = net

    def spawn(self, spec: WorkerSpec) -> WorkerHandle:
        role = spec.role
        config = dataclasses.replace(spec.config, host=self.net.addr[role])
        spec = dataclasses.replace(spec, config=config)
        cmd = ["ip", "netns", "exec", self.net.ns[role], *worker_command(spec)]
        # `ip netns exec` execs the worker, so this process stays its parent
        proc = subprocess.Popen(
            [*cmd, "--exit-with-parent"], stdout=subprocess.PIPE, text=True, start_new_session=True
        )
        return WorkerHandle(Launched(spec, proc=proc))


@pytest.fixture(scope="module")
def reference(tiny_llama_path) -> list[list[int]]:  # type: ignore[no-untyped-def]
    llm = LLM(str(tiny_llama_path))
    return [o.outputs[0].token_ids for o in llm.generate(_prompts(), GREEDY)]


@pytest.fixture(scope="module")
def cluster(net, tiny_llama_path):  # type: ignore[no-untyped-def]
    # Off loopback, control messages must be authenticated: the workers inherit the secret
    # from the environment, and LocalCluster.start tags this process's messages with it.
    saved = os.environ.get(auth.ENV)
    os.environ[auth.ENV] = f"netns-test-secret-{os.getpid()}-{time.time_ns()}"
    c = NetnsCluster(
        str(tiny_llama_path),
        net,
        threads=1,
        deadline_s=DEADLINE_S,
        lease_s=LEASE_S,
        prefill_args={"block_size": 4},
        decode_args={"block_size": 16},
    )
    try:
        with c:
            yield c
    finally:
        for w in c.workers:  # close() already waited and killed; this is belt and braces
            if w.launched.proc is not None and w.launched.proc.poll() is None:
                w.launched.proc.kill()
                w.launched.proc.wait()
        m.set_key(None)  # later tests in this process run unauthenticated on loopback
        if saved is None:
            os.environ.pop(auth.ENV, None)
        else:
            os.environ[auth.ENV] = saved


def _ids(outs) -> list[list[int]]:  # type: ignore[no-untyped-def]
    assert all(o.error is None for o in outs), [o.error for o in outs]
    return [o.outputs[0].token_ids for o in outs]


def _durations(outs) -> list[float]:  # type: ignore[no-untyped-def]
    return [o.metrics.finished_time - o.metrics.arrival_time for o in outs]


def _check_idle(cluster: LocalCluster) -> None:
    stats = cluster.wait_idle()
    for wid, s in stats.items():
        assert s["kv_blocks_used"] == 0, (wid, s)
        assert s["transfers_out"] == 0 and s["transfers_in"] == 0, (wid, s)
        assert s["running"] == 0 and s["waiting"] == 0, (wid, s)


# ---- tests -------------------------------------------------------------------------------------
def test_workers_in_their_own_namespaces_match_llm(cluster, net, reference) -> None:  # type: ignore[no-untyped-def]
    own_ns = os.readlink("/proc/self/ns/net")
    for w in cluster.workers:
        assert w.launched.proc is not None and w.info is not None
        assert os.readlink(f"/proc/{w.launched.proc.pid}/ns/net") != own_ns
        assert w.launched.control.startswith(f"tcp://{net.addr[w.role]}:"), w.launched.control
    d0 = next(w for w in cluster.workers if w.role == "decode")
    assert d0.info is not None and d0.info.kv_endpoint.startswith(f"tcp://{net.addr['decode']}:")

    outs = cluster.generate(_prompts(), GREEDY, timeout_s=60)
    assert _ids(outs) == reference
    assert cluster.stats["kv_send_frames"] > len(_prompts())  # the long prompt: several frames
    assert cluster.stats["retries"] == 0
    _check_idle(cluster)


def test_delay_and_loss_change_nothing_and_deadlines_hold(cluster, net, reference) -> None:  # type: ignore[no-untyped-def]
    before = dict(cluster.stats)
    dropped, retrans = net.dropped(), net.retransmits()
    net.impair(delay_ms=30, jitter_ms=10, loss=0.02)
    try:
        for _ in range(3):  # a few hundred packets: the 2% loss surely hits some
            outs = cluster.generate(_prompts(), GREEDY, timeout_s=60)
            assert _ids(outs) == reference  # TCP retransmitted what was lost
            assert max(_durations(outs)) < REQUEST_BOUND_S, _durations(outs)
        lost, resent = net.dropped() - dropped, net.retransmits() - retrans
    finally:
        net.heal()
    print(f"impairment: {'netem' if net.netem else 'bpf loss + tbf'}; "
          f"{lost} packets dropped, {resent} segments retransmitted")  # fmt: skip
    assert cluster.stats["retries"] == before.get("retries", 0)  # no hand-off needed a retry
    assert cluster.stats.get("workers_down", 0) == before.get("workers_down", 0)
    assert lost > 0  # (retransmits are printed, not asserted: a lost pure ACK needs none)
    _check_idle(cluster)


def test_cut_link_fails_within_the_deadline_and_recovers(cluster, net, reference) -> None:  # type: ignore[no-untyped-def]
    retries = cluster.stats["retries"]
    net.cut("prefill", "decode")
    try:
        t0 = time.monotonic()
        (out,) = cluster.generate(_prompts()[1:2], GREEDY, timeout_s=60)
        took = time.monotonic() - t0
    finally:
        net.heal()
    # Each attempt (the first and its one retry) ends at a worker deadline; then the request
    # ends with a clear error, or is completed by the router's fallback (D computes the KV
    # itself) — with the right tokens. Either way within the bound, never a hang.
    failures = [e for e, _, _ in out.timeline or [] if e.startswith("failed: ")]
    assert len(failures) == 2 and all(DEADLINE_RE.search(f) for f in failures), out.timeline
    assert cluster.stats["retries"] == retries + 1
    assert 2 * DEADLINE_S <= took < REQUEST_BOUND_S, took
    if out.error is not None:
        assert out.outputs[0].finish_reason == "error" and DEADLINE_RE.search(out.error), out
    else:
        assert out.outputs[0].token_ids == reference[1]

    # TCP resends what P queued during the cut on its backed-off timer: wait until D has it all
    eventually(lambda: net.unsent("prefill", "decode") == 0, 30, "P's link to D to drain", 0.2)
    retries = cluster.stats["retries"]
    outs = cluster.generate(_prompts()[1:3], GREEDY, timeout_s=60)
    assert _ids(outs) == reference[1:3]
    assert cluster.stats["retries"] == retries
    _check_idle(cluster)
