"""Faults a worker injects into its own engine on request (`SetFault`; tests and chaos runs)."""

from __future__ import annotations

import time
from typing import Any


def slow_layers(model: Any, delay_s: float) -> None:
    """Fault: each model layer sleeps `delay_s` after it computes (0: as built), so a step runs
    long while its layers keep finishing, as a big model's long prompt does on a CPU."""
    for layer in getattr(model, "layers", ()):  # a fake engine has none
        vars(layer).pop("forward", None)  # the class's forward again
        if delay_s > 0:
            layer.forward = _slowed(layer.forward, delay_s)


def _slowed(forward: Any, delay_s: float) -> Any:
    def slowed(*args: Any, **kwargs: Any) -> Any:
        out = forward(*args, **kwargs)
        time.sleep(delay_s)
        return out

    return slowed
