"""What the simulator knows about hardware and models: published numbers, nothing measured.

GPUs (`GPUS`): dense bf16 FLOP/s, HBM bandwidth and capacity, NVLink bandwidth per GPU and
direction, from the vendors' data sheets (SXM parts). Efficiency factors say how much of that a
serving engine gets: `mfu` of the FLOP/s in large matrix products, `mbu` of the HBM bandwidth
when streaming weights and KV, and a fixed `step_overhead_s` per engine step (kernel launches,
scheduling, sampling) that a roofline cannot see.

Models (`ModelShape`): the shapes in a Hugging Face `config.json` (layers, hidden, heads, KV
heads, vocab, intermediate; a Mixtral's num_local_experts and num_experts_per_tok, a
Qwen3-MoE's num_experts and moe_intermediate_size; the sliding-window layers, read as the
engine reads them: `hf_config.window_layers`). Shipped
for Llama-3.1-8B/70B and Qwen2.5-7B/32B (shapes only, no weights, in `configs/`); any other
config.json path works too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

CONFIG_DIR = Path(__file__).parent / "configs"
GB = 1e9
GIB = 1024**3


@dataclass(frozen=True)
class Gpu:
    name: str
    bf16_flops: float  # dense, per GPU
    hbm_bytes_s: float
    hbm_gib: float
    nvlink_bytes_s: float  # per GPU, one direction
    mfu: float = 0.6  # share of bf16_flops reached by prefill-sized matrix products
    mbu: float = 0.8  # share of hbm_bytes_s reached streaming weights and KV
    step_overhead_s: float = 0.0015  # per engine step: launches, scheduling, sampling
    allreduce_latency_s: float = 10e-6  # per all-reduce call
    memory_fraction: float = 0.9  # of HBM usable for weights + KV (activations, runtime)


# Data sheets: A100 SXM4 80GB (312 TFLOP/s bf16 dense, 2039 GB/s, NVLink3 600 GB/s both ways);
# H100 SXM5 (989 TFLOP/s, 3350 GB/s, NVLink4 900 GB/s); H200 SXM (989 TFLOP/s, 4800 GB/s, 141 GB).
GPUS: dict[str, Gpu] = {
    "a100": Gpu("A100-SXM4-80GB", 312e12, 2039 * GB, 80, 300 * GB),
    "h100": Gpu("H100-SXM5-80GB", 989e12, 3350 * GB, 80, 450 * GB),
    "h200": Gpu("H200-SXM-141GB", 989e12, 4800 * GB, 141, 450 * GB),
}
HARDWARE = ("cpu", *GPUS)


def gpu(name: str) -> Gpu:
    try:
        return GPUS[name.lower()]
    except KeyError:
        raise ValueError(
            f"unknown hardware {name!r}; choose one of {', '.join(HARDWARE)}"
        ) from None


@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool = False
    dtype_bytes: int = 2  # bf16 weights and KV
    max_len: int = 131072
    # A mixture of experts (Mixtral): `experts` MLPs of `intermediate` each, `experts_per_token`
    # of them computed per token. The weights held (and read by a step: a batch of many tokens
    # touches every expert, so the roofline takes all of them, an upper bound for small
    # batches) count every expert; the FLOPs only the chosen ones.
    experts: int = 1
    experts_per_token: int = 1
    # Layers with a sliding window (Gemma 2/3, Qwen2/3 with max_window_layers, Mistral):
    # `layer_kinds` is "s" (sliding) or "f" (full) per layer, "" when none slides, and
    # `sliding_window` their window. They size the simulated KV groups (sim/kv_groups.py),
    # the hand-off's bytes and the roofline's attention and KV reads (steptime.py).
    sliding_window: int | None = None
    layer_kinds: str = ""

    def __post_init__(self) -> None:
        for field in ("layers", "hidden", "heads", "kv_heads", "intermediate", "vocab"):
            if getattr(self, field) < 1:
                raise ValueError(f"model {self.name}: {field} must be >= 1")
        if not 1 <= self.experts_per_token <= self.experts:
            raise ValueError(
                f"model {self.name}: num_experts_per_tok {self.experts_per_token} must be in "
                f"[1, num_local_experts {self.experts}]"
            )
        if self.hidden % self.heads:
            raise ValueError(f"model {self.name}: hidden {self.hidden} is not a multiple of heads")
        check_windows(self.name, self.layers, self.sliding_window, self.layer_kinds)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def layer_params(self) -> int:
        """Weights of one decoder layer: q, k, v, o projections and the gated MLP (every
        expert's, and the router, in a mixture of experts)."""
        return self._layer_params(self.experts)

    @property
    def active_layer_params(self) -> int:
        """The weights of one layer a token multiplies by (its chosen experts only)."""
        return self._layer_params(self.experts_per_token)

    def _layer_params(self, experts: int) -> int:
        q = self.hidden * self.heads * self.head_dim
        kv = 2 * self.hidden * self.kv_heads * self.head_dim
        o = self.heads * self.head_dim * self.hidden
        router = self.hidden * self.experts if self.experts > 1 else 0
        return q + kv + o + experts * 3 * self.hidden * self.intermediate + router

    @property
    def params(self) -> int:
        embed = self.vocab * self.hidden
        return self.layers * self.layer_params + embed * (1 if self.tied else 2)

    @property
    def weight_bytes(self) -> int:
        return self.params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer for one token."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @classmethod
    def from_config(cls, name: str, cfg: dict[str, object]) -> ModelShape:
        def geti(key: str, default: int | None = None) -> int:
            value = cfg.get(key, default)
            if not isinstance(value, int | float) or isinstance(value, bool):
                raise ValueError(f"model config {name}: {key} is missing or not a number")
            return int(value)

        from pdserve.engine.models.hf_config import window_layers  # the engine's reading

        layers = geti("num_hidden_layers")  # checked before window_layers reads it
        window, types = window_layers(cfg, Path(name))
        # Qwen3-MoE names its experts num_experts (num_local_experts in transformers 5) and
        # their width moe_intermediate_size; its few dense layers (mlp_only_layers) are
        # counted as experts, a small overestimate of their weights.
        experts = geti("num_local_experts", geti("num_experts", 1))
        moe_width = experts > 1 and "moe_intermediate_size" in cfg
        width = "moe_intermediate_size" if moe_width else "intermediate_size"
        return cls(
            name=name,
            layers=layers,
            hidden=geti("hidden_size"),
            heads=geti("num_attention_heads"),
            kv_heads=geti("num_key_value_heads", geti("num_attention_heads")),
            intermediate=geti(width),
            vocab=geti("vocab_size"),
            tied=bool(cfg.get("tie_word_embeddings", False)),
            max_len=geti("max_position_embeddings", 131072),
            experts=experts,
            experts_per_token=geti("num_experts_per_tok", 1),
            sliding_window=window,
            layer_kinds="".join("s" if t == "sliding" else "f" for t in types),
        )


def check_windows(name: str, layers: int, window: int | None, kinds: str) -> None:
    """A window with at least one sliding layer among `layers` kinds, or neither."""
    if not kinds and window is None:
        return
    if len(kinds) != layers or set(kinds) - {"s", "f"} or "s" not in kinds:
        raise ValueError(
            f"model {name}: layer kinds {kinds!r} must be s (sliding) or f (full) for each of "
            f"{layers} layers, at least one s"
        )
    if window is None or window < 1:
        raise ValueError(f"model {name}: sliding layers need a window >= 1, got {window}")


def known_models() -> list[str]:
    return sorted(p.stem for p in CONFIG_DIR.glob("*.json"))


def model_shape(name_or_path: str) -> ModelShape:
    """A shipped model by name (`llama-3.1-8b`), or a config.json file / a folder holding one."""
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        path = CONFIG_DIR / f"{name_or_path.lower()}.json"
    if not path.is_file():
        raise ValueError(
            f"unknown model {name_or_path!r}: give a config.json path or one of "
            f"{', '.join(known_models())}"
        )
    try:
        cfg = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read the model config {path}: {e}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path} is not a config.json object")
    name = path.stem if path.name != "config.json" else path.parent.name
    return ModelShape.from_config(name, cfg)
