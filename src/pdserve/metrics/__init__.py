"""Prometheus metrics for the router: `Metrics` (hooks the RouterCore and the HTTP app call)."""

from pdserve.metrics.prometheus import Metrics

__all__ = ["Metrics"]
