"""Every control message that crosses a process boundary: typed dataclasses, one msgpack codec.

Wire form (version 1): a msgpack map {"v": 1, "t": <type name>, <field>: <value>, ...}.
`decode` never unpickles, bounds every size before allocating, rejects unknown types, unknown or
missing fields and wrongly typed values with `MessageError` (a ValueError) — a peer's bug or an
attacker gets an error, never a crash or an object of the wrong shape.

Sampling parameters travel as a plain dict and are rebuilt (and validated) by `SamplingParams`.

Authentication: once `set_key(secret)` has been called (once per process, at start-up, from the
deployment's shared secret: see auth.py), every encoded message ends with an HMAC-SHA256 tag of
the msgpack body, and `decode` rejects a message whose tag is missing or wrong before parsing it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import types
import typing
from dataclasses import dataclass
from typing import Any, Union

import msgpack

from pdserve.engine.request import SamplingParams

VERSION = 1
MAX_MESSAGE_BYTES = 32 << 20  # a 1M-token prompt as msgpack ints fits; KV never travels here


class MessageError(ValueError):
    """A control message that is malformed, too large, of an unknown type, or unauthenticated."""


TAG_BYTES = 32  # HMAC-SHA256
_KEY: bytes | None = None  # the deployment's shared secret; None: messages carry no tag


def set_key(secret: bytes | None) -> None:
    """Tag every message this process encodes, and require tags on all it decodes."""
    global _KEY
    _KEY = secret


def _tag(body: bytes, key: bytes) -> bytes:
    return hmac.new(key, body, hashlib.sha256).digest()


# ---- router/client -> worker ------------------------------------------------------------------
@dataclass(frozen=True)
class Hello:
    client: str
    subscribe: bool = True  # receive KVEvents (routers do; a test harness's side socket does not)


@dataclass(frozen=True)
class Generate:
    """Run the whole request here (colocated worker, or a decode worker prefilling locally)."""

    rid: str
    prompt_ids: list[int]
    params: dict[str, Any]
    conversation: str = ""  # a turn of this conversation: keep its KV for the next turn


@dataclass(frozen=True)
class Prefill:
    """Prefill here, stream the KV to `dest_endpoint`, hand over after `handoff_tokens`."""

    rid: str
    prompt_ids: list[int]
    params: dict[str, Any]
    dest_worker: str
    dest_endpoint: str
    handoff_tokens: int = 1


@dataclass(frozen=True)
class ExpectKV:
    """Reserve blocks for a request whose KV `src_worker` will push here."""

    rid: str
    prompt_ids: list[int]
    params: dict[str, Any]
    src_worker: str
    handoff_tokens: int = 1
    conversation: str = ""  # a turn of this conversation: keep its KV for the next turn


@dataclass(frozen=True)
class Abort:
    rid: str


@dataclass(frozen=True)
class GetStats:
    pass


@dataclass(frozen=True)
class GetSteps:
    """The engine steps that began at or after `since` (time.monotonic()), answered by Steps."""

    since: float = 0.0


@dataclass(frozen=True)
class SetFault:
    """Fault injection (tests and chaos runs only): on this worker's outgoing KV frames, its
    acks, or its engine steps."""

    # "none" | "drop" | "delay" | "corrupt" (P's frames) | "drop_ack" (D's acks) |
    # "slow" (sleep delay_s before each engine step) | "slow_layers" (each model layer sleeps
    # delay_s after it computes, until "none": a long step that makes progress)
    mode: str
    count: int = 1  # frames (steps, for "slow") affected, -1 for all
    delay_s: float = 0.0


@dataclass(frozen=True)
class Ping:
    """Liveness probe, sent to a worker's heartbeat socket (answered by its own thread)."""

    seq: int


@dataclass(frozen=True)
class Shutdown:
    pass


@dataclass(frozen=True)
class SetRole:
    """Change the role this worker advertises (the router drains it first); answered with
    WorkerInfo. Every worker can run every message, so a role is what a router sends it."""

    role: str


@dataclass(frozen=True)
class SetThreads:
    """Run the engine on `threads` torch intra-op threads from the next engine step on (the
    router's thread mover, router/threads.py); 0: hold engine steps (KV still received) until
    a count above 0. Answered with Stats, whose `threads` (0 while held) is the
    acknowledgement. `step_tokens` caps what one engine step computes from then on (0: the
    engine's own budget): small steps while a worker is short of the host's cores, so that
    cores moving to it apply soon; whole-budget steps once it has them all."""

    threads: int
    step_tokens: int = 0


# ---- worker -> router/client ------------------------------------------------------------------
@dataclass(frozen=True)
class WorkerInfo:
    worker_id: str
    role: str
    pid: int
    kv_endpoint: str
    block_size: int
    num_blocks: int
    fingerprint: bytes
    model: str
    hb_endpoint: str = ""  # heartbeat socket: Ping -> Pong, answered even mid engine step
    # KV pools this worker reads and writes (workers/pool.py `pool_ids`); the router's pool
    # index counts a block stored by any worker of a pool as held by every worker of it
    kv_pools: list[str] = dataclasses.field(default_factory=list)
    # What `fingerprint` covers, in words (the weights, their formats, the KV layout): the
    # router names it when two workers' fingerprints disagree and it refuses to pair them.
    kv_desc: str = ""


@dataclass(frozen=True)
class Tokens:
    """New tokens of a request (and its end, when `finished`)."""

    rid: str
    worker: str
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[dict[int, float]] | None = None
    # The worker hands the request to a decode worker after these tokens (prefill side).
    handoff: bool = False
    time: float = 0.0  # time.monotonic() when the worker emitted them
    # Stage stamps (prefill_start, first_token) on the last message of this worker's part.
    times: dict[str, float] | None = None
    index: int = 0  # the choice of an n-choice request; `finished` ends that choice only
    # With the request's first tokens from a worker with a KV pool: what the pool did for it
    # (lookup_at, hit_tokens, loaded_tokens, local_tokens, load_s; engine/pool_link.py)
    pool: dict[str, float] | None = None
    # With a choice's last tokens from a speculating worker: draft_tokens, accepted_tokens,
    # steps (engine/spec/: drafts verified, accepted, steps that verified drafts)
    spec: dict[str, int] | None = None
    # With this worker's last tokens of the request: prompt tokens it found cached (its prefix
    # cache and KV pool) instead of computing them; -1: not reported
    cached: int = -1


@dataclass(frozen=True)
class TransferReport:
    """How a request's KV moved (sent by both ends when a hand-off completes)."""

    rid: str
    worker: str
    side: str  # "send" | "recv"
    frames: int
    nbytes: int
    seconds: float
    codec: str
    # time.monotonic() stamps of the hand-off's stages on this worker (one clock per host).
    times: dict[str, float] | None = None
    cached: int = -1  # recv: leading tokens whose KV D held already (not sent); -1: not reported


@dataclass(frozen=True)
class RequestFailed:
    rid: str
    worker: str
    reason: str
    stage: str  # "prefill" | "transfer" | "decode" | "admission"


@dataclass(frozen=True)
class Pong:
    seq: int
    worker_id: str
    loop_age_s: float  # since the worker's main loop last turned: tells stuck from busy
    # since it last made progress (its loop turned or a model layer finished): a loop that has
    # not turned for minutes while layers finish is one long step; -1: not reported
    work_age_s: float = -1.0


@dataclass(frozen=True)
class Stats:
    stats: dict[str, Any]


@dataclass(frozen=True)
class Steps:
    """A worker's engine steps, each `engine.step_log.StepRecord.to_wire()`, and the threads
    each ran on (empty: not recorded)."""

    worker_id: str
    steps: list[list[float]]
    threads: list[int] = dataclasses.field(default_factory=list)


@dataclass(frozen=True)
class KVEvents:
    """Prefix-cache changes since the last KVEvents, pushed to every router that said Hello:
    block hashes (sha256 of parent hash + token ids, the same in every process) that became
    reusable here, and those evicted. `cleared`: the worker's whole cache was dropped first
    (a restart, a reset); `seq` numbers the messages so a gap tells the router to resync."""

    worker_id: str
    seq: int
    block_size: int
    stored: list[bytes]
    removed: list[bytes]
    cleared: bool = False


# ---- prefill worker <-> decode worker (beside the KV frames) ----------------------------------
@dataclass(frozen=True)
class KVWant:
    rid: str
    src_worker: str


@dataclass(frozen=True)
class KVReady:
    rid: str
    # D already holds the KV of the first `have_tokens` tokens (its prefix cache): P sends the rest
    have_tokens: int = 0


@dataclass(frozen=True)
class KVDone:
    rid: str
    output_ids: list[int]
    num_kv_tokens: int
    frames: int
    # n > 1: the first token of choices 1..n-1, sampled on P from the prompt's logits; D forks
    # those choices from the one KV it received
    fork_ids: list[int] = dataclasses.field(default_factory=list)


@dataclass(frozen=True)
class KVAck:
    rid: str


@dataclass(frozen=True)
class KVFail:
    rid: str
    reason: str


Message = Union[  # noqa: UP007 (a runtime union for the registry)
    Hello,
    Generate,
    Prefill,
    ExpectKV,
    Abort,
    GetStats,
    GetSteps,
    SetFault,
    Shutdown,
    SetRole,
    SetThreads,
    Ping,
    Pong,
    WorkerInfo,
    Tokens,
    TransferReport,
    RequestFailed,
    Stats,
    Steps,
    KVEvents,
    KVWant,
    KVReady,
    KVDone,
    KVAck,
    KVFail,
]
REGISTRY: dict[str, type] = {cls.__name__: cls for cls in typing.get_args(Message)}


def sampling_params(values: dict[str, Any]) -> SamplingParams:
    """Rebuild (and validate) sampling parameters sent as a dict."""
    names = {f.name for f in dataclasses.fields(SamplingParams)}
    unknown = set(values) - names
    if unknown:
        raise MessageError(f"unknown sampling parameters {sorted(map(str, unknown))}")
    try:
        return SamplingParams(**values)
    except TypeError as e:
        raise MessageError(f"bad sampling parameters: {e}") from None


def encode(msg: Any) -> bytes:
    name = type(msg).__name__
    if REGISTRY.get(name) is not type(msg):
        raise MessageError(f"not a control message: {type(msg)!r}")
    body = {"v": VERSION, "t": name, **{f.name: getattr(msg, f.name) for f in _fields(name)}}
    packed: bytes = msgpack.packb(body, use_bin_type=True)
    return packed if _KEY is None else packed + _tag(packed, _KEY)


def decode(data: bytes | memoryview) -> Any:
    if len(data) > MAX_MESSAGE_BYTES:
        raise MessageError(f"message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    key = _KEY
    if key is not None:
        # authenticate before parsing: an unauthenticated peer's bytes reach no parser
        data = bytes(data)
        body_bytes, tag = data[:-TAG_BYTES], data[-TAG_BYTES:]
        if len(data) <= TAG_BYTES or not hmac.compare_digest(tag, _tag(body_bytes, key)):
            raise MessageError("unauthenticated control message (missing or wrong HMAC tag)")
        data = body_bytes
    try:
        # Bounded before parsing (MAX_MESSAGE_BYTES); msgpack sizes every container from the
        # buffer it already holds, so a lying length cannot allocate beyond it.
        body = msgpack.unpackb(data, raw=False, strict_map_key=False, use_list=True)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise MessageError(f"undecodable message: {e}") from None
    if not isinstance(body, dict) or body.get("v") != VERSION:
        raise MessageError("not a version-1 control message")
    t = body.get("t")
    cls = REGISTRY.get(t) if isinstance(t, str) else None  # a list tag is unhashable: TypeError
    if cls is None:
        raise MessageError(f"unknown message type {body.get('t')!r}")
    return _build(cls, {k: v for k, v in body.items() if k not in ("v", "t")})


def _fields(name: str) -> tuple[dataclasses.Field, ...]:
    return dataclasses.fields(REGISTRY[name])


def _build(cls: type, values: dict[str, Any]) -> Any:
    hints = _hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(values) - names
    if unknown:
        raise MessageError(f"{cls.__name__}: unknown fields {sorted(map(str, unknown))}")
    required = {
        f.name
        for f in dataclasses.fields(cls)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    }
    missing = required - set(values)
    if missing:
        raise MessageError(f"{cls.__name__}: missing fields {sorted(missing)}")
    for key, value in values.items():
        if not _conforms(value, hints[key]):
            raise MessageError(f"{cls.__name__}.{key}: bad value of type {type(value).__name__}")
    return cls(**values)


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _conforms(value: Any, hint: Any) -> bool:
    """A small runtime type check for the shapes messages use."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return True
    if origin in (Union, types.UnionType):
        return any(_conforms(value, a) for a in args)
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin is list:
        return isinstance(value, list) and all(_conforms(v, args[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict) and all(
            _conforms(k, args[0]) and _conforms(v, args[1]) for k, v in value.items()
        )
    return isinstance(value, hint)
