"""A Hugging Face `config.json` -> ModelArch, refusing what the model code does not implement.

Every feature a config can switch on is either read into ModelArch or refused here, naming the
file and the field, before any weight loads: a model never runs with a feature silently
dropped (an MLP bias, a RoPE scaling we do not apply, another activation).
Both spellings transformers has written are read: 5.x (`rope_parameters`, per layer type for
Gemma 3; `layer_types`) and 4.x (`rope_theta` + `rope_scaling`, `rope_local_base_freq`,
`sliding_window_pattern`, no `layer_types`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pdserve.engine.models import moe
from pdserve.engine.models.arch import FAMILIES, ModelArch

HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",  # Qwen3's attention, a mixture of experts (models/moe.py)
    "MistralForCausalLM": "mistral",
    "MixtralForCausalLM": "mixtral",  # Mistral's attention, a mixture of experts (models/moe.py)
    "Phi3ForCausalLM": "phi3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
}
# A bare config.save_pretrained() writes no `architectures`, only its model_type.
MODEL_TYPES = {**{a: a for a in FAMILIES}, "gemma3_text": "gemma3"}
HIDDEN_ACTS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
ROPE_TYPES = ("default", "llama3", "linear")
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
_LAYER_TYPES = {"full_attention": "full", "sliding_attention": "sliding"}


def arch_from_config(folder: Path) -> ModelArch:
    file = folder / "config.json"
    cfg: dict[str, Any] = json.loads(file.read_text())
    arch = _architecture(cfg, file)
    family = FAMILIES[arch]
    _refuse_unsupported(cfg, file, arch)
    heads = int(cfg["num_attention_heads"])
    theta, scaling, local_theta = _rope(cfg, file)
    scalar = cfg.get("query_pre_attn_scalar") if family.sandwich_norms else None
    return ModelArch(
        architecture=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        # Gemma ties its head to the embeddings unless told otherwise.
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", family.sandwich_norms)),
        # Qwen2 always has q/k/v bias (its config has no switch); the others refuse it above.
        attention_bias=family.qkv_bias,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_eos_ids(folder, cfg),
        name=str(cfg.get("_name_or_path") or folder.name),
        hidden_act=_hidden_act(cfg, file),
        sliding_window=int(cfg["sliding_window"]) if cfg.get("sliding_window") else None,
        layer_types=_layer_types(cfg, file, arch),
        local_rope_theta=local_theta,
        query_scale=float(scalar) ** -0.5 if scalar else None,
        attn_softcap=_optional_float(cfg.get("attn_logit_softcapping")),
        final_softcap=_optional_float(cfg.get("final_logit_softcapping")),
        moe=moe.hf_moe_arch(cfg, file, arch),
    )


def _architecture(cfg: dict[str, Any], file: Path) -> str:
    names = cfg.get("architectures") or []
    arch = next((HF_ARCHITECTURES[n] for n in names if n in HF_ARCHITECTURES), None)
    if not names and cfg.get("model_type") in MODEL_TYPES:
        arch = MODEL_TYPES[cfg["model_type"]]
    if arch is None:
        raise ValueError(
            f"Unsupported architecture {names or cfg.get('model_type')} in {file}; "
            f"supported: {', '.join(HF_ARCHITECTURES)}."
        )
    return arch


def _refuse(file: Path, field: str, value: object, why: str) -> ValueError:
    return ValueError(f"{file}: {field}={value!r} is not supported ({why}).")


def _refuse_unsupported(cfg: dict[str, Any], file: Path, arch: str) -> None:
    if cfg.get("mlp_bias"):
        raise _refuse(file, "mlp_bias", cfg["mlp_bias"], "the MLP projections have no bias here")
    if cfg.get("attention_bias") and not FAMILIES[arch].qkv_bias:
        raise _refuse(
            file, "attention_bias", cfg["attention_bias"], "no bias on q/k/v/o outside Qwen2"
        )
    if cfg.get("use_bidirectional_attention"):
        raise _refuse(file, "use_bidirectional_attention", True, "decoder attention here is causal")


def _hidden_act(cfg: dict[str, Any], file: Path) -> str:
    field = "hidden_activation" if cfg.get("hidden_activation") else "hidden_act"
    name = cfg.get(field) or "silu"
    if name not in HIDDEN_ACTS:
        raise _refuse(file, field, name, f"supported: {', '.join(HIDDEN_ACTS)}")
    return HIDDEN_ACTS[name]


def _rope(cfg: dict[str, Any], file: Path) -> tuple[float, dict[str, Any] | None, float | None]:
    """(RoPE base, its scaling, the sliding layers' own base or None) of every layout."""
    params: dict[str, Any] = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    field = "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling"
    local_theta = cfg.get("rope_local_base_freq")  # Gemma 3, transformers 4.x
    if "full_attention" in params:  # per layer type (Gemma 3, transformers 5)
        local = params.get("sliding_attention") or {}
        _rope_scaling(local, file, f"{field}.sliding_attention")  # refuses any but default
        local_theta = local.get("rope_theta", local_theta)
        params, field = params["full_attention"], f"{field}.full_attention"
    theta = float(params.get("rope_theta") or cfg.get("rope_theta") or 10000.0)
    for partial in (params.get("partial_rotary_factor"), cfg.get("partial_rotary_factor")):
        if partial not in (None, 1, 1.0):
            raise _refuse(file, "partial_rotary_factor", partial, "RoPE rotates whole heads here")
    scaling = _rope_scaling(params, file, field)
    return theta, scaling, float(local_theta) if local_theta is not None else None


def _rope_scaling(params: dict[str, Any], file: Path, field: str) -> dict[str, Any] | None:
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in (None, "default"):
        return None
    if kind not in ROPE_TYPES or (field.endswith("sliding_attention") and kind != "default"):
        raise _refuse(file, f"{field}.rope_type", kind, f"supported: {', '.join(ROPE_TYPES)}")
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(params["factor"])}
    return {"rope_type": "llama3", **{k: params[k] for k in _LLAMA3_KEYS}}


def window_layers(cfg: dict[str, Any], file: Path) -> tuple[int | None, tuple[str, ...]]:
    """The sliding window and "sliding" | "full" per layer, as `arch_from_config` reads them
    ((None, ()) when no layer slides), for a config of any architecture: the simulator sizes
    its KV from shapes alone. An architecture the model code does not implement slides only
    where its config lists `layer_types` (no rule of its own to apply)."""
    names = cfg.get("architectures") or []
    known = any(n in HF_ARCHITECTURES for n in names) or (
        not names and cfg.get("model_type") in MODEL_TYPES
    )
    if not known and cfg.get("layer_types") is None:
        return None, ()
    types = _layer_types(cfg, file, _architecture(cfg, file) if known else "")
    return (int(cfg["sliding_window"]), types) if types else (None, ())


def _layer_types(cfg: dict[str, Any], file: Path, arch: str) -> tuple[str, ...]:
    """ "sliding" | "full" per layer; () when no layer has a window."""
    n, window = int(cfg["num_hidden_layers"]), cfg.get("sliding_window")
    given = cfg.get("layer_types")
    if given is not None:
        bad = sorted({t for t in given if t not in _LAYER_TYPES})
        if bad or len(given) != n:
            raise _refuse(file, "layer_types", bad or given, f"{n} of {', '.join(_LAYER_TYPES)}")
        types = tuple(_LAYER_TYPES[t] for t in given)
    elif arch == "gemma2":  # transformers 4.x: even layers slide
        types = tuple("sliding" if i % 2 == 0 else "full" for i in range(n))
    elif arch == "gemma3":  # transformers 4.x: every pattern-th layer is global
        pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)
        types = tuple("full" if (i + 1) % pattern == 0 else "sliding" for i in range(n))
    elif arch in ("qwen2", "qwen3"):  # the window, when used, from max_window_layers on
        first = int(cfg.get("max_window_layers", n)) if cfg.get("use_sliding_window") else n
        types = tuple("sliding" if i >= first else "full" for i in range(n))
    elif arch == "qwen3_moe":  # the window, when used, on every layer (Qwen3MoeAttention)
        types = tuple("sliding" if cfg.get("use_sliding_window") else "full" for _ in range(n))
    else:  # Mistral, Phi-3: every layer, when the config has a window
        types = tuple("sliding" for _ in range(n))
    if "sliding" not in types or not window:
        return ()
    return types


def _optional_float(value: object) -> float | None:
    return None if value is None else float(value)  # type: ignore[arg-type]


def _eos_ids(folder: Path, cfg: dict[str, Any]) -> tuple[int, ...]:
    """Union of config.json and generation_config.json EOS ids (chat models list extras there)."""
    ids = _as_id_list(cfg.get("eos_token_id"))
    gen_file = folder / "generation_config.json"
    if gen_file.is_file():
        ids += _as_id_list(json.loads(gen_file.read_text()).get("eos_token_id"))
    return tuple(dict.fromkeys(ids))


def _as_id_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]
