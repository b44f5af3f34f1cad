"""Which rows of a step run which weight format, when a model holds a prefill format
(engine/prefill_format.py builds and attaches it): `StepRows`, planned once a step by the model,
and `PromptWeights`, one layer's bfloat16 copies for steps of prompt rows only.

Here, below the model code, so that the model (models/llama.py) reads these without importing
prefill_format.py, which imports the model's quantization (engine/quantize.py) in turn.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdserve.engine.linear.bf16 import Bf16Kernel, BF16Linear

# Fewer prompt rows than this in a step run on the decode format (colocated engines): a few
# rows are bandwidth-bound, where the 4-bit weights' fewer bytes win.
MIN_PROMPT_ROWS = 32


@dataclass
class PromptWeights:
    """One layer's bfloat16 projections and the ops between them, for steps whose every row
    is a prompt row (LlamaLayer.forward_prompt): bfloat16 from GEMM to GEMM."""

    rows: StepRows
    linears: dict[str, BF16Linear]
    ops: Bf16Kernel  # rms_norm, silu_mul, widen_add

    @property
    def active(self) -> bool:
        """This step runs every row on the prefill format (StepRows.set planned it)."""
        return self.rows.first_prompt_row == 0 and self.rows.planned


class StepRows:
    """Rows [0, first_prompt_row) of this step run the decode format, the rest the prefill
    format; shared by a model's PhaseProjections, set once a step (LlamaModel.forward)."""

    def __init__(self, has_decode_format: bool) -> None:
        self.has_decode_format = has_decode_format
        self.first_prompt_row = 0
        # What prompt rows' attention computes in where no kernel below takes it (bf16:
        # torch's flash SDPA in bfloat16; None: as the model, float32).
        self.prompt_dtype: torch.dtype | None = None
        # Prompt rows' causal attention on AMX tiles (prefill_format.prompt_attention: bf16x3
        # scores, or one bfloat16 product for bf16; head_dim 64, else SDPA).
        self.prompt_attention: Callable[..., torch.Tensor] | None = None
        self.planned = False  # the current step runs some rows on the prefill format
        self.prompt_rows_run = 0  # prompt rows computed on the prefill format, since start
        self.prompt_rows_decode_format = 0  # prompt rows left on the decode format (too few)

    def set(self, num_rows: int, num_decodes: int) -> bool:
        """Plan a step of `num_rows` rows whose first `num_decodes` are decodes; True when any
        row runs on the prefill format (their attention then runs in bfloat16 too)."""
        prompt = num_rows - num_decodes
        if self.has_decode_format and prompt < MIN_PROMPT_ROWS:
            self.first_prompt_row = num_rows
            self.prompt_rows_decode_format += prompt
            self.planned = False
            return False
        self.first_prompt_row = num_decodes if self.has_decode_format else 0
        self.prompt_rows_run += prompt
        self.planned = True
        return True
