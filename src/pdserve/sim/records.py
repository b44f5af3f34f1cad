"""What the simulator takes and gives: the requests (`SimRequest`), the deployment's knobs
(`SimConfig`) and what happened to each request (`Record`). Plain data, no event loop."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.config import CacheConfig, RouterConfig
from pdserve.deployment import ADAPTIVE_PREFILL_CHUNK
from pdserve.engine.scheduler import SchedulerPolicy
from pdserve.router import slo
from pdserve.sim.spec import SpecModel


@dataclass(frozen=True)
class SimRequest:
    """One request of the input: when it arrives, its prompt ids and how many tokens it wants."""

    rid: str
    arrival: float
    prompt: list[int]
    max_tokens: int
    conversation: int = -1  # turns of one conversation wait for the previous turn to end
    turn: int = 0
    phase: str | None = None
    # the answer's tokens where a later turn's prompt carries them (multiturn): the workers
    # sample these, so the KV a worker caches for the answer is the next prompt's history
    answer: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.prompt:
            raise ValueError(f"request {self.rid}: empty prompt")
        if self.max_tokens < 1:
            raise ValueError(f"request {self.rid}: max_tokens must be >= 1")
        if not self.arrival >= 0:
            raise ValueError(f"request {self.rid}: arrival must be >= 0 s")


@dataclass
class Record:
    """What happened to one request (the simulation's output, one per input request)."""

    rid: str
    prompt_len: int
    max_tokens: int
    phase: str | None
    turn: int = 0  # of its conversation (0: the first, or no conversation)
    arrival: float = 0.0
    route: str | None = None
    workers: tuple[str, ...] = ()
    rejected: str | None = None
    first_at: float | None = None
    last_at: float | None = None
    finished_at: float | None = None
    tokens: int = 0
    cached_tokens: int = 0  # prompt tokens the prefilling worker found cached (pool included)
    pool_tokens: int = 0  # of those, loaded from the KV pool
    kv_bytes: int = 0
    predicted_ttft: float | None = None
    predicted_tpot: float | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_at is None else self.first_at - self.arrival

    @property
    def tpot(self) -> float | None:
        if self.first_at is None or self.last_at is None or self.tokens < 2:
            return None
        return (self.last_at - self.first_at) / (self.tokens - 1)


@dataclass(frozen=True)
class SimConfig:
    prefill: int = 0
    decode: int = 0
    colocated: int = 0
    policy: SchedulerPolicy = field(default_factory=SchedulerPolicy)
    prefill_policy: SchedulerPolicy | None = None  # P's own (default: `policy`)
    block_size: int = 16
    prefix_caching: bool = True
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None
    planner: bool = False  # route with the SloPlanner (else the round-robin policy)
    admission: bool = False
    disaggregation: str = "always"  # with the planner: always | conditional
    prefix_routing: bool = False
    autobalance: bool = False
    expected_output: int = 256
    router_policy: str = "round_robin"
    message_s: float = 0.0  # one control message router <-> worker
    max_model_len: int | None = None  # a longer prompt is refused, as the engine refuses it
    kv_pool: bool = False  # a KV pool shared by every worker (sim/pool.py)
    kv_pool_blocks: int | None = None  # its capacity (None: unbounded)
    kv_pool_bytes_s: float | None = None  # its link per worker (None: the P -> D link's)
    spec: SpecModel | None = None  # speculative decoding on D and colocated workers (sim/spec.py)
    # a later turn of a conversation follows the router's rule without a planner
    # (router/routing.py `follow`): to the D that decoded the previous turn, prefilled there
    # when at most `conversation_local_tokens` of its prompt are not cached there, else on P
    # (D keeps each finished turn `conversation_ttl_s`, engine/kept_turns.py); off: every
    # turn is routed like any request and no turn is kept
    multiturn_reuse: bool = True
    conversation_ttl_s: float = CacheConfig.conversation_ttl  # the server's defaults
    conversation_local_tokens: int = RouterConfig.conversation_local_tokens
    # adaptive: the cores P and D share, their threads moved by router/threads.py (0: off)
    thread_cores: int = 0
    thread_grain: int = ADAPTIVE_PREFILL_CHUNK  # adaptive: P's step cap while short of cores

    def __post_init__(self) -> None:
        if min(self.prefill, self.decode, self.colocated) < 0:
            raise ValueError("worker counts must be >= 0")
        if self.colocated == 0 and (self.prefill < 1 or self.decode < 1):
            raise ValueError("give at least one prefill and one decode worker, or colocated > 0")
        if self.disaggregation not in slo.MODES:
            raise ValueError(f"disaggregation must be one of {', '.join(slo.MODES)}")
        for name in ("slo_ttft_s", "slo_tpot_s"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"{name} must be > 0 s, got {v}")
        if self.message_s < 0:
            raise ValueError("message_s must be >= 0")
        if not self.conversation_ttl_s >= 0 or self.conversation_local_tokens < 0:
            raise ValueError("conversation_ttl_s and conversation_local_tokens must be >= 0")
        if (self.admission or self.prefix_routing or self.autobalance) and not self.planner:
            raise ValueError("admission, prefix routing and autobalance need the planner")
        if self.thread_cores and (not self.planner or self.colocated or self.autobalance):
            raise ValueError("moving threads needs the planner, P and D pools, no autobalance")
