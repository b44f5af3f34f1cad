"""What the loader derives from a model file once and keeps under the cache directory
($PDSERVE_CACHE_DIR or ~/.cache/pdserve, `config.cache_dir`), so later starts skip the work.

Two things, both from a GGUF file, whose header (49k tokens and merges) the gguf library parses
into ~300k numpy views in seconds:
- its index (`gguf_index`): the metadata the loader reads and where each tensor's bytes are,
  kept as JSON; the weights are then read straight from the file (a memmap), as before;
- its tokenizer (`gguf_tokenizer`), converted by transformers (which parses the header again)
  and saved as tokenizer.json + its config (a quarter second to load).
Each entry is one per version of its source file (path, size, modification time), of the
library that made it and of its own format; entries are written beside and renamed into place,
so readers see all or nothing. A broken entry is said, removed and made again: never silently
kept, never silently skipped.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from pdserve.config import cache_dir

if TYPE_CHECKING:
    from gguf import GGMLQuantizationType
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

INDEX_VERSION = 1  # of the index's JSON; a new one makes every index again
SMALL_ARRAY = 64  # metadata arrays up to this long are kept whole; longer ones by length only


# ---- the GGUF index ---------------------------------------------------------------------------
@dataclass(frozen=True)
class GgufTensor:
    name: str
    tensor_type: int  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF's order: fastest-varying first
    offset: int  # of its data, from the start of the file
    n_bytes: int

    @property
    def qtype(self) -> GGMLQuantizationType:
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(self.tensor_type)


@dataclass(frozen=True)
class GgufIndex:
    """What the loader needs from a GGUF file's header, without parsing it again."""

    byte_order: Literal["I", "S"]  # the gguf reader's: "I" host order, "S" swapped
    metadata: dict[str, Any]  # every field but long arrays (those: `array_lengths`)
    array_lengths: dict[str, int]  # every array field's length (the vocabulary's, for one)
    tensors: tuple[GgufTensor, ...]

    def field(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def data(self, file: np.ndarray, tensor: GgufTensor) -> np.ndarray:
        """The tensor's bytes in `file` (the GGUF file as uint8, e.g. a memmap), viewed as the
        gguf reader views them: float/int types as their dtype, quantized ones as the rows of
        their blocks' bytes; shaped slowest-varying first (torch's order)."""
        from gguf.quants import quant_shape_to_byte_shape

        qtype = tensor.qtype
        dims = tuple(reversed(tensor.shape))
        raw = file[tensor.offset : tensor.offset + tensor.n_bytes]
        dtype = _PLAIN_DTYPES.get(qtype.name)
        if dtype is None:
            return raw.reshape(quant_shape_to_byte_shape(dims, qtype))
        view = raw.view(np.dtype(dtype).newbyteorder(self.byte_order))
        return view.reshape(dims)


_PLAIN_DTYPES = {
    "F16": np.float16, "F32": np.float32, "F64": np.float64,
    "I8": np.int8, "I16": np.int16, "I32": np.int32, "I64": np.int64,
}  # fmt: skip


@functools.lru_cache(maxsize=4)
def gguf_index(gguf: Path) -> GgufIndex:
    """The file's index, made once (the header parsed by the gguf library: ~2.5 s on the
    default model) and read from the cache directory after (milliseconds)."""
    saved = index_cache_path(gguf)
    if saved.is_file():
        try:
            index = _index_from_json(json.loads(saved.read_text()))
            size = gguf.stat().st_size
            if any(t.offset < 0 or t.offset + t.n_bytes > size for t in index.tensors):
                raise ValueError(f"a tensor lies outside the file's {size} bytes")
            return index
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("indexing the GGUF file again: the saved index %s fails (%s)", saved, e)
            saved.unlink(missing_ok=True)
    index = _build_index(gguf)
    _save(saved, lambda staging: staging.write_text(json.dumps(asdict(index))))
    return index


class UnknownTensorType(ValueError):
    """A GGUF tensor whose type id the gguf package does not know (a newer llama.cpp's)."""


def _reader(gguf: Path) -> Any:
    """gguf's GGUFReader, but a tensor of a type it does not know is named with its type id
    (the reader itself fails on it with only the id, as if the file were damaged)."""
    from gguf import GGMLQuantizationType, GGUFReader

    known = {int(t) for t in GGMLQuantizationType}

    class Reader(GGUFReader):
        def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
            for field in fields:
                name, tensor_type = bytes(field.parts[1]).decode(errors="replace"), field.parts[4]
                if int(tensor_type[0]) not in known:
                    raise UnknownTensorType(
                        f"{gguf}: tensor {name} has GGML type id {int(tensor_type[0])}, which "
                        "this build's gguf package does not know (a newer format?)"
                    )
            super()._build_tensors(start_offs, fields)

    return Reader(gguf)


def _build_index(gguf: Path) -> GgufIndex:
    from gguf import GGUFValueType

    try:
        reader = _reader(gguf)
    except UnknownTensorType:
        raise
    except (ValueError, IndexError, OSError, KeyError) as e:  # a cut or damaged header
        raise ValueError(f"{gguf} is not a readable GGUF file (cut short or damaged?): {e}") from e
    metadata: dict[str, Any] = {}
    lengths: dict[str, int] = {}
    for name, field in reader.fields.items():
        if field.types and field.types[0] == GGUFValueType.ARRAY:
            lengths[name] = len(field.data)
            if len(field.data) > SMALL_ARRAY:
                continue
        metadata[name] = field.contents()
    tensors = tuple(
        GgufTensor(
            t.name,
            int(t.tensor_type),
            tuple(int(d) for d in t.shape),
            int(t.data_offset),
            int(t.n_bytes),
        )
        for t in reader.tensors
    )
    _check_inside(gguf, tensors)
    return GgufIndex(reader.byte_order, metadata, lengths, tensors)


def _check_inside(gguf: Path, tensors: tuple[GgufTensor, ...]) -> None:
    """A file cut short (an interrupted download) names its first missing tensor, before any
    weight loads, instead of failing later in a reshape."""
    size = gguf.stat().st_size
    for t in tensors:
        if t.offset + t.n_bytes > size:
            raise ValueError(
                f"{gguf} is truncated: tensor {t.name} needs bytes {t.offset}-"
                f"{t.offset + t.n_bytes}, the file has {size}"
            )


def _index_from_json(raw: dict[str, Any]) -> GgufIndex:
    tensors = tuple(
        GgufTensor(t["name"], t["tensor_type"], tuple(t["shape"]), t["offset"], t["n_bytes"])
        for t in raw["tensors"]
    )
    if raw["byte_order"] not in ("I", "S"):
        raise ValueError(f"byte order {raw['byte_order']!r}")
    return GgufIndex(raw["byte_order"], raw["metadata"], raw["array_lengths"], tensors)


def gguf_tokenizer(gguf: Path) -> PreTrainedTokenizerBase:
    """A GGUF file's tokenizer, converted once and saved (tokenizer.json and its config) under
    the cache directory, then loaded from there.

    Why: transformers builds it by parsing the file's whole header again (49k tokens and merges
    as numpy views: ~4 s of a ~12 s start on the default model, in every worker and on every
    restart); the saved files load in ~0.25 s. A saved copy that no longer loads is said and
    replaced, never silently kept."""
    from transformers import AutoTokenizer

    saved = tokenizer_cache_path(gguf)
    if (saved / "tokenizer_config.json").is_file():
        try:
            cached: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(
                str(saved), local_files_only=True
            )
            return cached
        except (OSError, ValueError) as e:
            log.warning("converting the tokenizer again: the saved copy %s fails (%s)", saved, e)
            shutil.rmtree(saved, ignore_errors=True)
    tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, local_files_only=True
    )
    _save(saved, lambda staging: tokenizer.save_pretrained(str(staging)))
    return tokenizer


def index_cache_path(gguf: Path) -> Path:
    """Where a GGUF file's index is kept (a JSON file)."""
    entry = _entry_path("gguf-index", gguf, _library_version("gguf"))
    return entry.with_name(f"{entry.name}.json")  # not with_suffix: names hold dots (".Q4_1")


def tokenizer_cache_path(gguf: Path) -> Path:
    """Where a GGUF file's converted tokenizer is kept (a folder)."""
    return _entry_path("tokenizers", gguf, _library_version("transformers"))


# ---- entries ----------------------------------------------------------------------------------
def _library_version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


def _entry_path(kind: str, source: Path, maker: str) -> Path:
    """One entry per version of its source file (path, size, modification time) and of the
    library that made it (`maker`), so a changed file or library makes it afresh."""
    st = source.stat()
    key = f"{source.resolve()}|{st.st_size}|{st.st_mtime_ns}|{maker}|{INDEX_VERSION}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_dir() / kind / f"{source.stem}-{digest}"


def _save(saved: Path, write: Any) -> None:
    """`write(staging)` makes the entry beside (a file or a folder), then it is renamed into
    place: a reader sees all or nothing, and of two processes making it at once the first
    rename wins (both made the same thing). A cache that cannot be written (read-only home)
    only costs the next start its seconds again, and says so."""
    try:
        saved.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{saved.name}-", dir=saved.parent))
        try:
            write(staging / "entry")
            os.rename(staging / "entry", saved)
        except OSError:
            if not saved.exists():
                raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    except OSError as e:
        log.warning("could not save %s: %s", saved, e)
