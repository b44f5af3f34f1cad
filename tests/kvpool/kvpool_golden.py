"""Regenerate the golden pool values: `.venv/bin/python tests/kvpool/kvpool_golden.py`.

They pin the stored value format (kvpool/values.py) byte for byte: regenerate them only for a
deliberate format change, with a new VERSION (values written by older workers must then be
refused, not misread)."""

from __future__ import annotations

from pathlib import Path

import torch

from pdserve.kvpool import PoolNamespace
from pdserve.kvpool.values import VERSION, encode_value

GOLDEN_DIR = Path(__file__).parent / "golden"
NAMESPACE = PoolNamespace("golden-model", "float32", "0123abcd", block_size=4, codec="none")
BLOCK_HASH = bytes(range(32))  # the chunk's last block's hash
CODECS = ("none", "int8")
FIRST, BLOCKS = 6, 2  # the golden chunk: blocks 6-7 of a chain (C = 4 or 8: a partial chunk)


def golden_block() -> torch.Tensor:
    """A chunk [blocks=2, layers=2, K|V, block_size=4, kv_heads=2, head_dim=4]: exact in
    float32 and int8."""
    n = 2 * 2 * 2 * 4 * 2 * 4
    return (torch.arange(n, dtype=torch.float32).reshape(2, 2, 2, 4, 2, 4) - 120) / 16


def golden_key(codec: str) -> bytes:
    ns = PoolNamespace(NAMESPACE.model, NAMESPACE.dtype, NAMESPACE.layout, 4, codec)
    return ns.key(BLOCK_HASH)


def main() -> None:
    GOLDEN_DIR.mkdir(exist_ok=True)
    for codec in CODECS:
        path = GOLDEN_DIR / f"value_v{VERSION}_{codec}.bin"
        path.write_bytes(encode_value(golden_key(codec), golden_block(), FIRST, codec))
        print(path)


if __name__ == "__main__":
    main()
