"""The process's own Prometheus registry and the `/metrics` route that serves it.

Every sample a service exports carries its `constant_labels` (the run's `run_id`): they are added at
collection time by `LabelledView`, so no metric declares them and no call site passes them. A sample that
already has a label of that name keeps its own value. Code that reads the registry directly
(`registry.get_sample_value`) sees the samples as declared, without the constant labels.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.gc_collector import GCCollector
from prometheus_client.metrics_core import Metric
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector


class ServiceRegistry(CollectorRegistry):
    """A registry with the labels every sample of its exposition carries (`{"run_id": ...}`)."""

    def __init__(self, constant_labels: Mapping[str, str] | None = None) -> None:
        super().__init__()
        self.constant_labels = dict(constant_labels or {})


class LabelledView:
    """What `generate_latest` reads: the families of `registry`, each sample with `labels` added."""

    def __init__(self, registry: CollectorRegistry, labels: Mapping[str, str]) -> None:
        self.registry, self.labels = registry, dict(labels)

    def collect(self) -> Iterator[Metric]:
        for family in self.registry.collect():
            if self.labels:
                family = copy.copy(family)  # the collector's own family object stays as it was
                family.samples = [
                    s._replace(labels={**s.labels, **self._missing(s.labels)}) for s in family.samples
                ]
            yield family

    def _missing(self, labels: Mapping[str, str]) -> dict[str, str]:
        return {k: v for k, v in self.labels.items() if k not in labels}


def make_registry(constant_labels: Mapping[str, str] | None = None) -> ServiceRegistry:
    """A fresh registry for one service process, with the standard process / platform / GC collectors;
    `constant_labels` (the run's `{"run_id": ...}`) go on every sample `/metrics` exports."""
    registry = ServiceRegistry(constant_labels)
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    return registry


def exposition(registry: CollectorRegistry) -> bytes:
    """The Prometheus text format of `registry`, its constant labels (if any) on every sample."""
    return generate_latest(LabelledView(registry, getattr(registry, "constant_labels", {})))  # type: ignore[arg-type]


router = APIRouter(tags=["health"])


@router.get(
    "/metrics",
    summary="Prometheus metrics of this process",
    response_class=Response,
    responses={200: {"content": {CONTENT_TYPE_LATEST: {}}, "description": "Prometheus text format"}},
)
async def metrics(request: Request) -> Response:
    registry: CollectorRegistry = request.app.state.registry
    return Response(exposition(registry), media_type=CONTENT_TYPE_LATEST)
