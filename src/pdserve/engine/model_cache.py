"""What the loader derives from a model file once and keeps under the cache directory
($PDSERVE_CACHE_DIR or ~/.cache/pdserve, `config.cache_dir`), so later starts skip the work.

Today: a GGUF file's tokenizer, converted by transformers (seconds) and saved as
tokenizer.json + its config (a quarter second to load). Each entry is one folder per version of
its source file (path, size, modification time) and of the converting library; entries are
written beside and renamed into place, so readers see all or nothing. A broken entry is said,
removed and made again: never silently kept, never silently skipped.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve.config import cache_dir

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)


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
    _save_tokenizer(tokenizer, saved)
    return tokenizer


def tokenizer_cache_path(gguf: Path) -> Path:
    """Where a GGUF file's converted tokenizer is kept: one folder per file version (path,
    size, modification time) and transformers version, so a changed file or library converts
    afresh."""
    import transformers

    st = gguf.stat()
    key = f"{gguf.resolve()}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_dir() / "tokenizers" / f"{gguf.stem}-{digest}"


def _save_tokenizer(tokenizer: PreTrainedTokenizerBase, saved: Path) -> None:
    """Written beside, then renamed into place: a process that reads it sees all or nothing,
    and of two processes converting at once the first rename wins. A cache that cannot be
    written (read-only home) only costs the next start its seconds again, and says so."""
    try:
        saved.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{saved.name}-", dir=saved.parent))
        tokenizer.save_pretrained(str(staging))
        try:
            staging.rename(saved)
        except OSError:  # another process got there first: its copy is the same conversion
            shutil.rmtree(staging, ignore_errors=True)
    except OSError as e:
        log.warning("could not save the converted tokenizer under %s: %s", saved.parent, e)
