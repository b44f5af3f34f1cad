"""The model an engine runs: its settings resolved and checked (`plan`), then the weights loaded,
quantized into the decode format (`--quantization`), and given their prefill format's copies
(`--prefill-format`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.config import ModelConfig, resolve_kv_cache_dtype
from pdserve.engine import loader, moe_quant, prefill_format, quantize
from pdserve.engine.kv_cache import kv_cache_dtype
from pdserve.engine.loader import ModelSource
from pdserve.engine.models.arch import ModelArch
from pdserve.engine.models.gemma import layer_class
from pdserve.engine.models.llama import LlamaModel

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class WeightPlan:
    """What an engine's model and KV cache come to, settled before the slow load."""

    device: torch.device
    dtype: torch.dtype
    source: ModelSource
    quantization: str  # `auto` made concrete
    kv_dtype: torch.dtype
    decode_matmul: str  # tiles | torch


def plan(mc: ModelConfig, kv_cache_dtype_name: str) -> WeightPlan:
    """Resolve the model's settings, refusing at once (not after the slow load) what cannot
    run here: a KV cache dtype, a quantization or a decode matmul this machine lacks."""
    device, dtype = torch.device(mc.device), DTYPES[mc.dtype]
    source = loader.resolve_model(mc.model)
    quantization = quantize.resolve_quantization(mc.quantization, source, device, dtype)
    kv_name = resolve_kv_cache_dtype(kv_cache_dtype_name, quantization, mc.dtype)
    kv_dtype = kv_cache_dtype(kv_name, dtype)
    quantize.check_supported(quantization, device, dtype)
    matmul = quantize.decode_matmul(mc.decode_matmul, quantization, device, dtype)
    return WeightPlan(device, dtype, source, quantization, kv_dtype, matmul)


def build_model(
    source: ModelSource, arch: ModelArch, mc: ModelConfig, quantization: str, decode_matmul: str
) -> tuple[LlamaModel, prefill_format.PrefillChoice]:
    """The model in eval mode, and what its prompt rows run on (logged here)."""
    device, dtype = torch.device(mc.device), DTYPES[mc.dtype]
    weights = loader.load_weights(source, arch, dtype)
    with torch.device("meta"):
        model = LlamaModel(arch, layer_class(arch))
    model = model.to_empty(device=device).to(dtype).requires_grad_(False)
    model.load_hf_weights({k: v.to(device) for k, v in weights.items()})
    del weights
    gguf = None
    if quantization in quantize.GGUF_QUANTIZATIONS:
        gguf = quantize.gguf_weights(source, arch)
    units = prefill_format.probe_units()
    kind, why = prefill_format.wanted(
        mc.prefill_format, mc.phases, quantization, device, dtype, units,
        prefill_format.projection_sizes(arch),
    )  # fmt: skip
    if arch.moe is not None:
        kind, why = moe_quant.prefill_format(mc.prefill_format, kind, why)
    # The copies come from the float weights, which quantization frees.
    copies = prefill_format.make_copies(model, kind) if kind != "none" else None
    quantize.quantize_model(model, quantization, gguf=gguf)
    moe_quant.quantize_experts(model, quantization, moe_quant.gguf_experts(source, arch, gguf))
    if decode_matmul == "tiles":
        quantize.tile_model(model)
    choice = prefill_format.PrefillChoice("none", units.isa, why)
    if copies is not None:
        choice = prefill_format.attach(model, copies, mc.prefill_format, mc.phases, units)
    prefill_format.log_choice(choice, quantization, mc.phases)
    model.decode_rows_attention = prefill_format.decode_rows_attention(
        mc.prefill_format, choice, quantization, device, dtype, units
    )
    return model.eval(), choice
