"""config.json -> ModelArch (engine/models/hf_config.py): what each family reads, both
transformers layouts, and the features refused before any weight loads, naming file and field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import tiny_arch
from pdserve.engine import loader
from pdserve.engine.models.hf_config import arch_from_config


def _arch_of(tmp_path: Path, name: str, **overrides: Any):  # type: ignore[no-untyped-def]
    tiny_arch.build(name, **overrides).config.save_pretrained(tmp_path)
    return arch_from_config(tmp_path)


def _edited(tmp_path: Path, name: str, **fields: Any) -> Path:
    """A config.json of variant `name` with `fields` set as a file would hold them (no weights:
    the refusal must come before the loader looks for any)."""
    tiny_arch.build(name).config.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.update(fields)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def test_gemma2_reads_its_features(tmp_path) -> None:  # type: ignore[no-untyped-def]
    a = _arch_of(tmp_path, "gemma2")
    assert a.architecture == "gemma2" and a.hidden_act == "gelu_tanh"
    assert a.layer_types == ("sliding", "full", "sliding", "full")
    assert a.attention(0).window == tiny_arch.WINDOW and a.attention(1).window is None
    assert a.attention(0).softcap == 2.0 and a.final_softcap == 3.0
    assert a.query_scale == pytest.approx(24**-0.5) and a.tie_word_embeddings


def test_gemma3_transformers_4_layout(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """4.x: no layer_types (every 6th layer global), rope_theta + rope_scaling for the global
    layers, rope_local_base_freq for the sliding ones."""
    path = _edited(
        tmp_path, "gemma3", num_hidden_layers=7, layer_types=None, rope_parameters=None,
        rope_theta=1e6, rope_scaling={"rope_type": "linear", "factor": 8.0},
        rope_local_base_freq=10000.0, sliding_window_pattern=6,
    )  # fmt: skip
    a = arch_from_config(path)
    assert a.layer_types == ("sliding",) * 5 + ("full", "sliding")
    assert (a.rope_theta, a.local_rope_theta) == (1e6, 10000.0)
    assert a.rope_scaling == {"rope_type": "linear", "factor": 8.0}


def test_windows_a_config_switches_off_are_not_applied(tmp_path) -> None:  # type: ignore[no-untyped-def]
    assert _arch_of(tmp_path, "qwen2.5").layer_types == ()


def test_mistral_window_is_a_window_not_the_context_limit(tmp_path) -> None:  # type: ignore[no-untyped-def]
    a = _arch_of(tmp_path, "mistral-window")
    assert a.max_position_embeddings == 2048
    assert all(a.attention(i).window == tiny_arch.WINDOW for i in range(a.num_layers))


@pytest.mark.parametrize(
    ("name", "fields", "field"),
    [
        ("llama3.2", {"mlp_bias": True}, "mlp_bias"),
        ("llama3.2", {"attention_bias": True}, "attention_bias"),
        ("llama3.2", {"hidden_act": "gelu"}, "hidden_act"),
        ("gemma2", {"hidden_activation": "relu"}, "hidden_activation"),
        ("llama3.2", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_type"),
        ("phi3", {"rope_parameters": {"rope_type": "longrope"}}, "rope_type"),
        ("phi3", {"partial_rotary_factor": 0.75}, "partial_rotary_factor"),
        ("gemma3", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ("mistral-window", {"layer_types": ["chunked_attention"] * 2}, "layer_types"),
    ],
)
def test_unimplemented_features_are_refused_naming_file_and_field(
    tmp_path, name, fields, field
) -> None:  # type: ignore[no-untyped-def]
    path = _edited(tmp_path, name, **fields)
    with pytest.raises(ValueError, match=rf"config\.json: \S*{field}=.*not supported"):
        loader.load_arch(loader.ModelSource("hf", path))


def test_an_unknown_architecture_names_the_supported_ones(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = _edited(tmp_path, "gemma3", architectures=["Gemma3ForConditionalGeneration"])
    with pytest.raises(ValueError, match=r"Unsupported architecture.*Gemma3ForCausalLM"):
        arch_from_config(path)
