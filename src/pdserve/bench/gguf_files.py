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


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="source .gguf (default: the default model)")
    p.add_argument("--ftype", default="Q4_K_M", choices=sorted(FTYPES))
    p.add_argument("--output", required=True, help="the .gguf file to write")


def run(args: argparse.Namespace) -> int:
    from pdserve.engine.loader import resolve_model

    src = resolve_model(args.model)
    if src.kind != "gguf":
        raise ValueError(f"--model must be a .gguf file, got {src.path}")
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".f32.gguf")
    float_copy(src.path, tmp)
    try:
        if args.ftype == "F32":
            tmp.replace(out)
        else:
            quantize(tmp, out, args.ftype)
    finally:
        tmp.unlink(missing_ok=True)
    print(f"wrote {out} ({args.ftype}, {out.stat().st_size / 1e6:.1f} MB) from {src.path.name}")
    return 0
