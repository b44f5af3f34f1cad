"""Per-expert quantized weights of mixture-of-experts layers (engine/models/moe.py).

Each expert's gate|up and down run on exactly the per-projection kernels a dense layer's do:
`quantize.quantize` (w8g32, w8a8, int8) on the expert's slice of the float weights, or under
`gguf*` the file's own blocks (`linear.gguf.projection`: the Q4_1 / Q8_0 linears, the gguf-a16
K-quant ones), one expert's rows of the file's 3-D ffn_{gate,up,down}_exps tensors at a time.
An expert is one kernel call on its group of rows, as a dense projection is one call on the
step's rows.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, cast

import numpy as np
import torch

from pdserve.engine import model_cache, quantize

if TYPE_CHECKING:
    from pdserve.engine.linear.base import Projection
    from pdserve.engine.linear.gguf import GgufWeight
    from pdserve.engine.loader import ModelSource
    from pdserve.engine.models.arch import ModelArch
    from pdserve.engine.models.llama import LlamaModel
    from pdserve.engine.models.moe import SparseMoe

# A GGUF expert tensor's parts, fused per projection as the dense layers fuse gate|up.
GGUF_EXPERT_PARTS = {"gate_up": ("ffn_gate_exps", "ffn_up_exps"), "down": ("ffn_down_exps",)}
# GGUF experts by (layer, file tensor kind, e.g. "ffn_up_exps"): one GgufWeight per expert.
GgufExperts = dict[tuple[int, str], list["GgufWeight"]]
_GGUF_EXPERT_NAME = re.compile(r"blk\.(\d+)\.(ffn_(?:gate|up|down)_exps)\.weight")


def quantize_experts(model: LlamaModel, name: str, gguf: GgufExperts | None = None) -> None:
    """Give every MoE layer's experts their quantized stand-ins (and the layer's native ops)
    and free the float expert weights; `none` keeps them float. Call after
    quantize.quantize_model, which quantizes the attention projections and sets `fused`."""
    if name == "none":
        return
    for i, layer in enumerate(quantize.layers_of(model)):
        moe = layer.moe
        if moe is None:
            continue
        moe.fused = layer.fused
        if gguf is not None:
            experts = _gguf_experts(moe, i, name, gguf)
        else:
            pairs = zip(moe.gate_up, moe.down, strict=True)  # per expert [in, out]
            experts = [(_quantized(name, g, "gate_up"), _quantized(name, d, "down"))
                       for g, d in pairs]  # fmt: skip
        if experts is None:  # float tensors in the file: the experts stay float
            continue
        moe.quantized = experts
        for weight in (moe.gate_up, moe.down):
            weight.data = weight.data.new_empty(0)


def _quantized(name: str, weight: torch.Tensor, proj: str) -> Projection:
    found = quantize.quantize(name, weight, None, proj)
    if found is None:
        raise ValueError(f"quantization {name!r} has no quantized form of an expert's {proj}")
    return found


def _gguf_experts(
    moe: SparseMoe, layer: int, name: str, gguf: GgufExperts
) -> list[tuple[Projection, Projection]] | None:
    """The file's own blocks per expert; None when the file stores the experts as floats."""
    from pdserve.engine.linear import gguf as gguf_linear

    out: list[tuple[Projection, Projection]] = []
    for e in range(moe.num_experts):
        pair = []
        for proj, kinds in GGUF_EXPERT_PARTS.items():
            parts = [gguf[(layer, kind)][e] for kind in kinds]
            weight = (moe.gate_up if proj == "gate_up" else moe.down)[e]
            what = f"layer {layer} expert {e} {proj}"
            acts = quantize.activations_of(name, proj)
            pair.append(gguf_linear.projection(parts, weight, None, what, acts))
        if any(p is None for p in pair):
            return None
        out.append((cast("Projection", pair[0]), cast("Projection", pair[1])))
    return out


def gguf_experts(
    source: ModelSource, arch: ModelArch, gguf: dict[str, GgufWeight] | None
) -> GgufExperts | None:
    """A GGUF MoE file's expert tensors as stored, one GgufWeight per expert (the 3-D
    tensors' rows [expert, out, bytes] cut per expert), when `gguf` (the file's 2-D weights,
    quantize.gguf_weights) is in use and the model has experts; else None."""
    if gguf is None or arch.moe is None:
        return None
    from pdserve.engine.linear.gguf import GgufWeight

    index = model_cache.gguf_index(source.path)
    file = np.memmap(source.path, dtype=np.uint8, mode="r")
    out: GgufExperts = {}
    for tensor in index.tensors:
        if len(tensor.shape) != 3:
            continue
        m = _GGUF_EXPERT_NAME.fullmatch(tensor.name)
        if m is None:
            raise ValueError(f"{source.path}: unknown 3-D tensor {tensor.name!r}")
        layer, kind = m.groups()
        experts, rows = int(tensor.shape[2]), int(tensor.shape[1])  # fastest-first: [in, out, E]
        raw = np.asarray(index.data(file, tensor)).view(np.uint8).reshape(experts, rows, -1)
        # copies: the file is mmapped
        out[(int(layer), kind)] = [GgufWeight(tensor.qtype.name, np.array(r)) for r in raw]
    return out


def prefill_format(asked: str, kind: str, why: str) -> tuple[str, str]:
    """What a mixture-of-experts model's prompt rows run on: the decode format. The prefill
    formats' bfloat16 copies are of dense projections only; asked for by name, refused."""
    if kind == "none":
        return kind, why
    if asked != "auto":
        raise ValueError(
            f"--prefill-format {asked} has no mixture-of-experts layers (its copies are of "
            "dense projections); use --prefill-format none or auto"
        )
    return "none", "a mixture-of-experts model's prompt rows run on the decode format"
