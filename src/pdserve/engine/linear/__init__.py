"""Projections: how a layer runs one weight matrix, y = x @ W (+ bias) (+ residual).

The bottom of the engine's weight path: `base.Projection` is the interface the model calls, and
each module here implements it on one kernel, which it reaches through a small typed Protocol
of that kernel's calls (engine/kernels builds the kernels):
- `int8`: int8 weights and activations on fbgemm (`--quantization int8`);
- `w8g32`: int8 weights, float32 activations (`w8g32`; gguf's Q8_0 tensors);
- `w8a8`: int8 weights against int8 / int16 activations (`w8a8`; gguf-a8 / gguf-a16's Q8_0);
- `gguf`: a GGUF file's own Q4_1 blocks (`gguf`, `gguf-a8`, `gguf-a16`), `gguf_a16` its other
  block formats (K-quants, Q4_0, Q5_*) under gguf-a16;
- `float32`: float32 weights as they are, and the float32 tiles of `--decode-matmul tiles`;
- `bf16`: the prefill format's bfloat16 and AMX (bf16x3) copies; `phases` which rows of a step
  run them (set by engine/prefill_format.py, read by the model).
Which projection a model gets is decided above this package, in engine/quantize.py.
"""
