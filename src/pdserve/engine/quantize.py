"""Which projection every weight matrix of a model gets: `--quantization none | int8 | w8g32 |
w8a8 | gguf | gguf-a8 | gguf-a16` (and `auto`), `--decode-matmul tiles`, and the checks that
refuse at start-up what cannot run. The projections themselves are in engine/linear/: each
scheme's module says how it computes and why (int8.py, w8g32.py, w8a8.py, gguf.py).

- `w8g32` re-rounds every projection to int8 with fp16 scales per 32 inputs, float32
  activations; `w8a8` the same weights against int8 activations (but q|k|v, see
  W8A8_FLOAT_ACTIVATIONS); `int8` per-channel int8 on fbgemm.
- `gguf`, `gguf-a8` and `gguf-a16` run a GGUF file's own Q4_1 / Q8_0 weights as stored, against
  float32, int8 or int16 activations.
The embedding lookup stays float32: a step reads only the rows of its own tokens.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, cast

import numpy as np
import torch

from pdserve.config import DECODE_MATMULS, QUANTIZATIONS, check_quantization
from pdserve.engine import kernels, loader, model_cache
from pdserve.engine.linear import gguf_a16
from pdserve.engine.linear.base import FusedOps, Projection
from pdserve.engine.linear.float32 import F32TileLinear
from pdserve.engine.linear.gguf import FLOAT_TYPES, GgufWeight
from pdserve.engine.linear.gguf import projection as gguf_projection
from pdserve.engine.linear.int8 import Int8Linear
from pdserve.engine.linear.w8a8 import W8A8Linear
from pdserve.engine.linear.w8g32 import W8G32Linear
from pdserve.engine.loader import ModelSource
from pdserve.engine.models import checkpoint, gguf_config

if TYPE_CHECKING:
    from pdserve.engine.models.arch import ModelArch
    from pdserve.engine.models.llama import LlamaLayer, LlamaModel

log = logging.getLogger(__name__)

LAYER_PROJECTIONS = ("qkv", "o", "gate_up", "down")
# A mixture-of-experts layer's dense projections: its MLP is its experts (engine/moe_quant.py).
ATTENTION_PROJECTIONS = ("qkv", "o")
# The quantizations that run pdserve's own kernels (w8g32.cpp, w8a8.cpp, q4_1.cpp) and its
# native RMSNorm / RoPE / silu * up (FusedOps).
NATIVE_QUANTIZATIONS = ("w8g32", "w8a8", "gguf", "gguf-a8", "gguf-a16")
# The quantizations that run a GGUF file's own weights: float32, int8 or int16 activations.
GGUF_QUANTIZATIONS = ("gguf", "gguf-a8", "gguf-a16")
# 16-bit float GGUF weights, run as float32 (a WARNING says so: no 16-bit decode kernel here).
HALF_TYPES = ("F16", "BF16")
# Projections `w8a8` keeps on float32 activations (W8G32Linear): q|k|v, whose input (the
# attention's RMSNorm output) was the one whose int8 rounding cost the most. Measured
# (docs/benchmarks/quant.md, 60 prompts x 64 tokens): with every projection's activations int8,
# 48.9% agreement with float32 and mean KL 4.5e-3, below llama.cpp's Q4_1 (49.3%, 3.1e-3);
# float32 activations for one projection at a time: qkv 54.3% / 3.2e-3, the others 43-49% /
# 3.8-4.2e-3. q|k|v is 16% of a layer's weights.
W8A8_FLOAT_ACTIVATIONS = ("qkv",)


def check_supported(name: str, device: torch.device, dtype: torch.dtype) -> None:
    """Refuse at start-up what cannot run quantized, instead of silently running float32."""
    check_quantization(name)
    if name == "none":
        return
    if device.type != "cpu":
        raise ValueError(f"quantization {name!r} runs on CPU only (device {device}); use none")
    if dtype != torch.float32:
        raise ValueError(
            f"quantization {name!r} takes float32 activations; use --dtype float32, not {dtype}"
        )
    if name in NATIVE_QUANTIZATIONS:
        if not kernels.cpu_supported():
            raise ValueError(
                f"quantization {name!r} needs a CPU with AVX2 + FMA (torch reports "
                f"{torch.backends.cpu.get_cpu_capability()}); use --quantization none"
            )
        return
    engines = torch.backends.quantized.supported_engines
    if "x86" not in engines and "fbgemm" not in engines:
        raise ValueError(
            f"quantization {name!r} needs torch's fbgemm int8 kernels (x86 CPUs); this torch "
            f"has only {engines}"
        )


def decode_matmul(name: str, quantization: str, device: torch.device, dtype: torch.dtype) -> str:
    """What `--decode-matmul name` means for this engine: "tiles" or "torch".

    `tiles` needs float32 projection weights (`--quantization none`, `--dtype float32`) on a
    CPU the native kernel runs on; asked for elsewhere it is refused at start-up, never dropped
    silently. `auto` is tiles wherever it runs, torch elsewhere (quantized models, CUDA)."""
    if name not in DECODE_MATMULS:
        raise ValueError(f"decode_matmul must be one of {', '.join(DECODE_MATMULS)}, got {name!r}")
    if name == "torch":
        return "torch"
    why = (
        f"quantization {quantization!r} (tiles hold float32 weights)"
        if quantization != "none"
        else f"device {device}"
        if device.type != "cpu"
        else f"dtype {str(dtype).removeprefix('torch.')}"
        if dtype != torch.float32
        else f"a CPU without AVX2 (torch reports {torch.backends.cpu.get_cpu_capability()})"
        if not kernels.cpu_supported()
        else None
    )
    if why is None:
        return "tiles"
    if name == "tiles":
        raise ValueError(f"decode_matmul 'tiles' cannot run with {why}; use auto or torch")
    return "torch"


def resolve_quantization(
    name: str,
    model: ModelSource | str | os.PathLike[str] | None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | str = "float32",
) -> str:
    """`--quantization auto` (the default) made concrete; any other name is returned as it is.

    auto is `gguf-a16` for a GGUF file whose weight matrices are all in formats with a kernel
    here (gguf_a16.FORMATS: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K; or float) and at
    least one quantized, on a CPU with AVX2, float32: the file's
    own weights, as llama.cpp and vLLM run a GGUF file, against int16 activations. Measured side
    by side (docs/benchmarks/quant.md, 60 chat prompts x 64 tokens, float16 KV): 59 of 60
    outputs equal to float32's under gguf-a16 as under gguf (float activations), KL 3.6e-7
    against 3.0e-7, in 0.71x the time; its projections take 0.58-0.66x gguf's at every row
    count (engine.md). Anything else (an HF folder, CUDA, bfloat16, a file in another block
    format or of 16-bit floats: both warned) is `none`.
    The choice is logged and shown wherever the quantization is (stats, /admin/workers, the
    cost-model file name)."""
    if name != "auto":
        return name
    src = model if isinstance(model, ModelSource) else loader.resolve_model(model)
    chosen = "none"
    on_cpu = torch.device(device).type == "cpu" and str(dtype).removeprefix("torch.") == "float32"
    kinds = gguf_weight_types(src) if src.kind == "gguf" else set()
    quantized = kinds - set(FLOAT_TYPES)
    if quantized and on_cpu and kernels.cpu_supported():
        if quantized <= set(gguf_a16.FORMATS):
            chosen = "gguf-a16"
        else:
            _warn_float(src, quantized - set(gguf_a16.FORMATS))
    elif on_cpu and kinds & set(HALF_TYPES) and not quantized:
        _warn_half(src, kinds & set(HALF_TYPES))
    log.info("quantization auto: %s (%s)", chosen, src.path.name)
    return chosen


def gguf_weight_types(src: ModelSource) -> set[str]:
    """The block formats of a GGUF file's weights: its 2-D tensors, and a mixture of experts'
    3-D [expert, out, in] ones (models/moe.py). Also what a worker's KV fingerprint names
    (workers/pool.py)."""
    index = model_cache.gguf_index(src.path)
    arch = index.field("general.architecture")
    return {
        t.qtype.name
        for t in index.tensors
        if len(t.shape) in (2, 3) and gguf_config.hf_name(t.name, arch, src.path) is not None
    }


def _warn_half(src: ModelSource, kinds: set[str]) -> None:
    """A 16-bit float file runs as float32 (no 16-bit decode kernel here): twice the bytes a
    decode step reads. Said at start-up, never silently (issue 44)."""
    log.warning(
        "%s holds %s weights, which run as float32 here (no 16-bit decode kernel): a decode "
        "step reads 2x the file's weight bytes, ~6x a 4-bit file's. Quantize it (a Q4_K_M or "
        "Q8_0 GGUF runs its own blocks) or pass --quantization w8g32 to requantize at load.",
        src.path.name,
        ", ".join(sorted(kinds)),
    )


def _warn_float(src: ModelSource, missing: set[str]) -> None:
    """A GGUF file holding block formats without a kernel here runs as float32: say so loudly,
    with the cost (issue 44: never silently as float)."""
    log.warning(
        "%s holds %s tensors, which pdserve has no kernel for: the whole model runs "
        "dequantized to float32 (--quantization none), reading ~7x the bytes a decode step of "
        "a 4-bit format reads (decode several times slower). Kernels exist for %s.",
        src.path.name,
        ", ".join(sorted(missing)),
        ", ".join(gguf_a16.FORMATS),
    )


def quantize(
    name: str, weight: torch.Tensor, bias: torch.Tensor | None = None, proj: str = ""
) -> Projection | None:
    """The quantized stand-in for a [in, out] weight, or None for `none` (keep the float);
    `proj` names the projection (a LAYER_PROJECTIONS name, "head" or "")."""
    if name == "none":
        return None
    if name == "int8":
        return Int8Linear(weight, bias)
    if name == "w8g32" or (name == "w8a8" and proj in W8A8_FLOAT_ACTIVATIONS):
        return W8G32Linear(weight, bias)
    if name == "w8a8":
        return W8A8Linear(weight, bias)
    raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {name!r}")


def activations_of(quantization: str, proj: str) -> str:
    """What projection `proj` (or "head") of a GGUF quantization multiplies its weights with:
    "float", "int8" (gguf-a8, but for q|k|v) or "int16" (gguf-a16)."""
    if quantization == "gguf-a8" and proj not in W8A8_FLOAT_ACTIVATIONS:
        return "int8"
    return "int16" if quantization == "gguf-a16" else "float"


def quantize_model(
    model: LlamaModel,
    name: str,
    head: bool = True,
    gguf: dict[str, GgufWeight] | None = None,
) -> None:
    """Replace every projection (and the LM head when `head`) by its quantized form, and free
    the float copies: a quantized model holds no float32 projection weights. `gguf` (the file's
    own tensors by HF name, gguf_weights) is what `gguf` runs."""
    if name == "none":
        return
    if name in GGUF_QUANTIZATIONS and gguf is None:
        raise ValueError(f"quantization {name} runs a GGUF file's own weights; this model has none")
    for i, layer in enumerate(layers_of(model)):
        for proj in projections_of(layer):
            bias = layer.qkv_bias if proj == "qkv" else None
            quantized = _stand_in(model, name, gguf, i, proj, getattr(layer, proj), bias)
            if quantized is not None:
                layer.quantized[proj] = quantized
                _free(getattr(layer, proj))
    if name in NATIVE_QUANTIZATIONS:
        fused = FusedOps()
        model.fused = fused
        for layer in layers_of(model):
            layer.fused = fused
    if head:
        model.quantized_head = _stand_in(model, name, gguf, -1, "head", model.lm_head, None)
        if model.quantized_head is not None:
            _free(model.lm_head)
    if gguf is not None:
        log.info("%s kernels: %s", name, kernel_summary(model))


def kernel_summary(model: LlamaModel) -> str:
    """Which kernel runs how many projections (the start-up log: a K-quant or 5-bit file's
    tensors on int8 codes say so here)."""
    stand_ins: list[Projection | None] = [
        q for layer in layers_of(model) for q in layer.quantized.values()
    ]
    stand_ins.append(model.quantized_head)
    counts: dict[str, int] = {}
    for q in stand_ins:
        kind = "float32" if q is None else getattr(q, "label", type(q).__name__)
        counts[kind] = counts.get(kind, 0) + 1
    return ", ".join(f"{n} x {kind}" for kind, n in sorted(counts.items()))


def _stand_in(
    model: LlamaModel,
    name: str,
    file: dict[str, GgufWeight] | None,
    layer: int,
    proj: str,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
) -> Projection | None:
    """Projection `proj` of `layer` (-1 and "head": the LM head) quantized: the file's own
    tensors where there is a file, else `weight` re-rounded; None keeps the float weight."""
    if file is None:
        return quantize(name, weight, bias, proj)
    parts = [file[n] for n in file_tensor_names(model, layer, proj)]
    what = "the LM head" if proj == "head" else f"layer {layer} {proj}"
    return gguf_projection(parts, weight, bias, what, activations_of(name, proj))


def _free(weight: torch.Tensor) -> None:
    """Drop a float weight's storage once its quantized stand-in holds it."""
    weight.data = weight.data.new_empty(0)


def tile_model(model: LlamaModel) -> None:
    """Give every float32 projection and the LM head its F32TileLinear (`decode_matmul`
    tiles); the float weights stay for prefill."""
    for layer in layers_of(model):
        for proj in projections_of(layer):
            bias = layer.qkv_bias if proj == "qkv" else None
            layer.quantized[proj] = F32TileLinear(getattr(layer, proj), bias)
    model.quantized_head = F32TileLinear(model.lm_head)


def file_tensor_names(model: LlamaModel, layer: int, proj: str) -> list[str]:
    """The HF tensor names a fused projection is made of, in the order they are fused."""
    if proj == "head":
        tied = model.arch.tie_word_embeddings
        return ["model.embed_tokens.weight" if tied else "lm_head.weight"]
    a, m = f"model.layers.{layer}.self_attn.", f"model.layers.{layer}.mlp."
    return {
        "qkv": [a + f"{n}_proj.weight" for n in "qkv"],
        "o": [a + "o_proj.weight"],
        "gate_up": [m + "gate_proj.weight", m + "up_proj.weight"],
        "down": [m + "down_proj.weight"],
    }[proj]


def projection_bytes(model: LlamaModel) -> int:
    """Bytes of projection weights + LM head that one decode step reads, as stored (quantized
    or not; a prefill format's copies, which decode rows never touch, not counted; of a
    mixture of experts, every expert's: a step reads those its tokens chose)."""
    total = 0
    for layer in layers_of(model):
        for proj in projections_of(layer):
            quantized = layer.quantized.get(proj)
            if quantized is None:
                total += getattr(layer, proj).nbytes
            else:
                total += int(getattr(quantized, "decode_nbytes", quantized.nbytes))
        total += layer.moe.nbytes if layer.moe is not None else 0
    head = model.quantized_head
    return total + (head.nbytes if head else model.lm_head.nbytes)


def projections_of(layer: LlamaLayer) -> tuple[str, ...]:
    """The layer's dense projections (LAYER_PROJECTIONS; ATTENTION_PROJECTIONS for a mixture of
    experts, whose experts engine/moe_quant.py quantizes)."""
    return LAYER_PROJECTIONS if layer.moe is None else ATTENTION_PROJECTIONS


def layers_of(model: LlamaModel) -> list[LlamaLayer]:
    return cast("list[LlamaLayer]", list(model.layers))


def gguf_weights(src: ModelSource, arch: ModelArch) -> dict[str, GgufWeight]:
    """Every 2-D weight of a GGUF model as the file stores it (its block format and raw rows),
    by HF name, Q/K rows unpermuted as in `_gguf_weights`: what `--quantization gguf` runs."""
    if src.kind != "gguf":
        raise ValueError(
            f"quantization gguf runs a GGUF file's own weights; {src.folder} is not a GGUF model"
        )
    index = model_cache.gguf_index(src.path)
    file = np.memmap(src.path, dtype=np.uint8, mode="r")
    gguf_arch = index.field("general.architecture")
    permuted = gguf_arch in gguf_config.PERMUTED
    out: dict[str, GgufWeight] = {}
    for tensor in index.tensors:
        name = gguf_config.hf_name(tensor.name, gguf_arch, src.path)
        if name is None or len(tensor.shape) != 2:
            continue
        rows = int(tensor.shape[1])  # GGUF lists dims fastest-first: [in, out]
        raw = np.asarray(index.data(file, tensor)).view(np.uint8).reshape(rows, -1)
        if permuted and ".self_attn.q_proj." in name:
            raw = gguf_config.unpermute_rows(raw, arch.num_heads)
        elif permuted and ".self_attn.k_proj." in name:
            raw = gguf_config.unpermute_rows(raw, arch.num_kv_heads)
        # Phi-3's fused q|k|v and gate|up: each part is a range of whole rows (blocks run
        # along a row), so the parts are the file's own blocks too.
        parts = checkpoint.fused_parts(name, arch) or [(name, 0, rows)]
        checkpoint.check_fused_rows(name, rows, parts)
        for part, start, end in parts:  # copies: the file is mmapped
            out[part] = GgufWeight(tensor.qtype.name, np.array(raw[start:end]))
    return out
