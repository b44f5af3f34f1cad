"""Regenerate the golden KV frames: `.venv/bin/python tests/transfer/make_golden.py`.

The goldens pin the current wire format byte for byte. Regenerate them only for a deliberate format
change, and then bump `wire.VERSION`: frames already in flight or on disk must keep decoding.
Inputs are exact small binary fractions, so every platform quantizes them identically.
"""

from __future__ import annotations

from pathlib import Path

import torch

from pdserve.engine.models.arch import ModelArch
from pdserve.transfer.wire import encode_frame

GOLDEN_DIR = Path(__file__).parent / "golden"
GOLDENS = {"kv_frame_v2.bin": "int8", "kv_frame_v2_none.bin": "none"}
# v1 goldens (zlib CRC-32) stay committed: they must keep decoding.
V1_GOLDENS = {"kv_frame_v1.bin": "int8", "kv_frame_v1_none.bin": "none"}
ARCH = ModelArch(
    "llama", vocab_size=32, hidden_size=12, intermediate_size=24, num_layers=2, num_heads=3,
    num_kv_heads=3, head_dim=4,
)  # fmt: skip
REQUEST_ID = "golden-req-0"
LAYER_START, TOKEN_START = 0, 16  # the second 16-token chunk of a prompt
N_TOKENS, HEADS, HEAD_DIM = 5, 3, 4


def golden_inputs() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """K and V of 2 layers: arange-based; layer 1's K head 2 is all zero (scale 0)."""
    base = torch.arange(N_TOKENS * HEADS * HEAD_DIM, dtype=torch.float32)
    base = base.reshape(N_TOKENS, HEADS, HEAD_DIM)
    keys = [(base - 30) / 8 * (layer + 1) for layer in range(2)]
    keys[1][:, 2] = 0
    values = [(base % 7 - 3) / 4 + layer for layer in range(2)]
    return keys, values


def golden_frame(codec: str) -> bytes:
    keys, values = golden_inputs()
    fingerprint = ARCH.kv_layout(torch.float32).fingerprint()
    parts = encode_frame(REQUEST_ID, LAYER_START, TOKEN_START, keys, values, codec, fingerprint)
    return b"".join(parts)


def main() -> None:
    GOLDEN_DIR.mkdir(exist_ok=True)
    for name, codec in GOLDENS.items():
        (GOLDEN_DIR / name).write_bytes(golden_frame(codec))
        print(f"wrote {GOLDEN_DIR / name}")


if __name__ == "__main__":
    main()
