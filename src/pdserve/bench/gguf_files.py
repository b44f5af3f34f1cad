"""Make GGUF files of other block formats from one we have: `pdserve bench gguf-requant`.

The default model ships as Q4_1. The formats people download (Q4_K_M, Q5_K_M ...) are made by
llama.cpp's quantizer from a float file, so: (1) `float_copy` writes the same model with every
tensor dequantized to F32 (metadata copied as the gguf package's gguf_new_metadata script
copies it), (2) `quantize` runs llama.cpp's `llama_model_quantize` through llama-cpp-python
(`make bench-peers` installs it) on that copy. The weights are then Q4_1's values re-rounded:
a real Q4_K_M file of this model would be made from its bfloat16 checkpoint, which is not here.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

# llama.cpp's llama_ftype values (llama.h) for the files this command makes.
FTYPES = {
    "F32": 0,
    "F16": 1,
    "Q4_0": 2,
    "Q4_1": 3,
    "Q8_0": 7,
    "Q5_0": 8,
    "Q5_1": 9,
    "Q4_K_M": 15,
    "Q5_K_M": 17,
    "Q6_K": 18,
}


def float_copy(src: Path, dst: Path) -> None:
    """`src` with every tensor dequantized to F32, metadata unchanged but the file type."""
    import gguf
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(src)
    arch = str(reader.fields[gguf.Keys.General.ARCHITECTURE].contents())
    writer = gguf.GGUFWriter(dst, arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        if field.name == gguf.Keys.General.FILE_TYPE:
            continue  # written below: the copy is all float32
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    writer.add_file_type(FTYPES["F32"])
    for t in reader.tensors:
        values = dequantize(t.data, t.tensor_type).astype(np.float32)
        # GGUF lists dims fastest-first; numpy wants the reverse
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        writer.add_tensor(t.name, values.reshape(shape))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def quantize(src: Path, dst: Path, ftype: str, threads: int = 2) -> None:
    """llama.cpp's quantizer: `src` (a float GGUF) -> `dst` in `ftype` (FTYPES)."""
    try:
        import llama_cpp
    except ImportError as e:
        raise RuntimeError(
            "llama.cpp's quantizer comes with llama-cpp-python: run `make bench-peers`"
        ) from e
    if ftype not in FTYPES:
        raise ValueError(f"ftype must be one of {', '.join(FTYPES)}, got {ftype!r}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[ftype]
    params.nthread = threads
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params)
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({src} -> {dst}, {ftype}) failed: {rc}")


# Random-weight models with the shapes of real ones (issue 44's speed comparison): the
# layer shapes of each model's config.json, the default model's tokenizer (49152 tokens, so
# prompts are real text; the embedding and LM head are therefore smaller than the real
# model's), untied norms at 1 and every other weight N(0, 0.02). Timing needs the shapes, not
# trained values.
SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": dict(arch="qwen2", hidden=896, layers=24, heads=14, kv_heads=2,
                         ffn=4864, rope_theta=1e6, qkv_bias=True),
    "llama-3.2-1b": dict(arch="llama", hidden=2048, layers=16, heads=32, kv_heads=8,
                         ffn=8192, rope_theta=5e5, qkv_bias=False),
    "qwen3-1.7b": dict(arch="qwen3", hidden=2048, layers=28, heads=16, kv_heads=8,
                       ffn=6144, rope_theta=1e6, qkv_bias=False, qk_norm=True),
    # a small mixture of experts in llama.cpp's Mixtral layout: 8 experts, top-2, ~1.0B
    # weights of which ~0.35B run per token
    "moe-8x2-1b": dict(arch="llama", hidden=1024, layers=16, heads=16, kv_heads=8,
                       ffn=2816, rope_theta=1e6, qkv_bias=False, experts=8, top_k=2),
}  # fmt: skip


def random_model(shape: str, dst: Path, seed: int = 0) -> None:
    """A float16 GGUF of random weights with the layer shapes of `shape` (SHAPES)."""
    import gguf

    from pdserve.engine.loader import resolve_model

    if shape not in SHAPES:
        raise ValueError(f"shape must be one of {', '.join(SHAPES)}, got {shape!r}")
    cfg = SHAPES[shape]
    arch, hidden, head_dim = cfg["arch"], cfg["hidden"], cfg["hidden"] // cfg["heads"]
    tokenizer = gguf.GGUFReader(resolve_model(None).path)
    writer = gguf.GGUFWriter(dst, arch)
    for field in tokenizer.fields.values():
        if field.name.startswith("tokenizer."):
            kind = field.types[0]
            sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    vocab = len(tokenizer.fields["tokenizer.ggml.tokens"].contents())
    writer.add_name(f"random {shape}")
    writer.add_file_type(FTYPES["F16"])
    writer.add_block_count(cfg["layers"])
    writer.add_context_length(8192)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(cfg["ffn"])
    writer.add_head_count(cfg["heads"])
    writer.add_head_count_kv(cfg["kv_heads"])
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(cfg["rope_theta"])
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(vocab)
    experts = cfg.get("experts", 0)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(cfg["top_k"])
    rng = np.random.default_rng(seed)

    def weight(*shape_: int) -> np.ndarray:
        return (rng.standard_normal(shape_, dtype=np.float32) * 0.02).astype(np.float16)

    kv = cfg["kv_heads"] * head_dim
    writer.add_tensor("token_embd.weight", weight(vocab, hidden))
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    for i in range(cfg["layers"]):
        b = f"blk.{i}."
        writer.add_tensor(b + "attn_norm.weight", np.ones(hidden, np.float32))
        writer.add_tensor(b + "ffn_norm.weight", np.ones(hidden, np.float32))
        for name, rows in (("attn_q", hidden), ("attn_k", kv), ("attn_v", kv)):
            writer.add_tensor(b + name + ".weight", weight(rows, hidden))
            if cfg["qkv_bias"]:
                writer.add_tensor(b + name + ".bias", np.zeros(rows, np.float32))
        if cfg.get("qk_norm"):  # Qwen3: RMSNorm weights of each q and k head
            writer.add_tensor(b + "attn_q_norm.weight", np.ones(head_dim, np.float32))
            writer.add_tensor(b + "attn_k_norm.weight", np.ones(head_dim, np.float32))
        writer.add_tensor(b + "attn_output.weight", weight(hidden, hidden))
        if experts:  # llama.cpp's 3-D expert tensors and the router
            writer.add_tensor(b + "ffn_gate_inp.weight", weight(experts, hidden))
            writer.add_tensor(b + "ffn_gate_exps.weight", weight(experts, cfg["ffn"], hidden))
            writer.add_tensor(b + "ffn_up_exps.weight", weight(experts, cfg["ffn"], hidden))
            writer.add_tensor(b + "ffn_down_exps.weight", weight(experts, hidden, cfg["ffn"]))
            continue
        writer.add_tensor(b + "ffn_gate.weight", weight(cfg["ffn"], hidden))
        writer.add_tensor(b + "ffn_up.weight", weight(cfg["ffn"], hidden))
        writer.add_tensor(b + "ffn_down.weight", weight(hidden, cfg["ffn"]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="source .gguf (default: the default model)")
    p.add_argument(
        "--shape",
        default=None,
        choices=sorted(SHAPES),
        help="instead of --model: random weights with this model's layer shapes (float16 GGUF, "
        "the default model's tokenizer)",
    )
    p.add_argument("--ftype", default="Q4_K_M", choices=sorted(FTYPES))
    p.add_argument("--output", required=True, help="the .gguf file to write")


def run(args: argparse.Namespace) -> int:
    from pdserve.engine.loader import resolve_model

    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".float.gguf")
    if args.shape:
        random_model(args.shape, tmp)
        origin = f"random {args.shape}"
    else:
        src = resolve_model(args.model)
        if src.kind != "gguf":
            raise ValueError(f"--model must be a .gguf file, got {src.path}")
        float_copy(src.path, tmp)
        origin = src.path.name
    try:
        if args.ftype == "F32" and not args.shape:
            tmp.replace(out)
        else:
            quantize(tmp, out, args.ftype)
    finally:
        tmp.unlink(missing_ok=True)
    print(f"wrote {out} ({args.ftype}, {out.stat().st_size / 1e6:.1f} MB) from {origin}")
    return 0
