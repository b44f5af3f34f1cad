"""pdserve: prefill/decode-disaggregated LLM serving.

`from pdserve import LLM, SamplingParams` is the offline API (shaped like vLLM's).
Heavy modules (torch, transformers) load lazily so `pdserve --help` stays fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams", "__version__"]

if TYPE_CHECKING:
    from pdserve.engine.llm import LLM
    from pdserve.engine.outputs import CompletionOutput, RequestOutput
    from pdserve.engine.request import SamplingParams


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from pdserve.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from pdserve.engine.request import SamplingParams

        return SamplingParams
    if name in ("RequestOutput", "CompletionOutput"):
        from pdserve.engine import outputs

        return getattr(outputs, name)
    raise AttributeError(name)
