"""Prometheus metrics: `perseus serve --metrics-port P` and `perseus monitor --prometheus-port P`
serve `/metrics` in the Prometheus text format (through prometheus-client, the `metrics` extra).

The service loop never talks to the scrape thread directly: it counts requests and reported
energy as it goes (`ServiceMetrics`, plain Python, no dependency) and, when a scrape asks,
publishes one immutable `ServiceSnapshot` at its next tick (`SnapshotBoard`); the collector
(`collectors`) turns that snapshot, or a Monitor's GPUs, into metric families. Names follow
Prometheus conventions (base units, `_total` counters) and dcgm-exporter's labels (`gpu`,
`UUID`, `modelName`) where they overlap; `exported_metrics()` lists every family.
"""

from perseus.metrics.board import SnapshotBoard
from perseus.metrics.service import ServiceMetrics, ServiceSnapshot

__all__ = ["ServiceMetrics", "ServiceSnapshot", "SnapshotBoard"]
