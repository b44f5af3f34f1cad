"""The model an engine runs: the weights loaded, quantized into the decode format
(`--quantization`), and given their prefill format's copies (`--prefill-format`)."""

from __future__ import annotations

import torch

from pdserve.config import ModelConfig
from pdserve.engine import loader, prefill_format, quant, quant_gguf
from pdserve.engine.loader import ModelSource
from pdserve.engine.models.arch import ModelArch
from pdserve.engine.models.gemma import layer_class
from pdserve.engine.models.llama import LlamaModel

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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
    if quantization in quant_gguf.GGUF_QUANTIZATIONS:
        gguf = quant_gguf.gguf_weights(source, arch)
    units = prefill_format.probe_units()
    kind, why = prefill_format.wanted(
        mc.prefill_format, mc.phases, quantization, device, dtype, units,
        prefill_format.projection_sizes(arch),
    )  # fmt: skip
    # The copies come from the float weights, which quantization frees.
    copies = prefill_format.make_copies(model, kind) if kind != "none" else None
    quant.quantize_model(model, quantization, gguf=gguf)
    if decode_matmul == "tiles":
        quant.tile_model(model)
    choice = prefill_format.PrefillChoice("none", units.isa, why)
    if copies is not None:
        choice = prefill_format.attach(model, copies, mc.prefill_format, mc.phases, units)
    prefill_format.log_choice(choice, quantization, mc.phases)
    return model.eval(), choice
