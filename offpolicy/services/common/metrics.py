"""The process's own Prometheus registry and the `/metrics` route that serves it.

Every sample a service exports carries its `constant_labels` (the run's `run_id`): they are added at
collection time by `LabelledView`, so no metric declares them and no call site passes them. A sample that
already has a label of that name keeps its own value. Code that reads the registry directly
(`registry.get_sample_value`) sees the samples as declared, without the constant labels.

An actor pool's runs each have a registry of their own (labelled with their run id); `MergedRegistries`,
registered on the service's registry, exports them all with it, one family per metric name.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Iterator, Mapping

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


def make_registry(
    constant_labels: Mapping[str, str] | None = None, process_collectors: bool = True
) -> ServiceRegistry:
    """A fresh registry for one service process, with the standard process / platform / GC collectors
    (`process_collectors`; False for the registry of one run of an actor pool, exported beside the
    process's); `constant_labels` (the run's `{"run_id": ...}`) go on every sample `/metrics` exports."""
    registry = ServiceRegistry(constant_labels)
    if process_collectors:
        ProcessCollector(registry=registry)
        PlatformCollector(registry=registry)
        GCCollector(registry=registry)
    return registry


class MergedRegistries:
    """A collector of the families of several registries (`registries()`, read at each collection), each
    sample with its registry's constant labels, families of one name merged into one (an actor pool's runs
    declare the same metrics, each with its own `run_id`). Registered on the service's registry."""

    def __init__(self, registries: Callable[[], Iterable[CollectorRegistry]]) -> None:
        self.registries = registries

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        for registry in self.registries():
            for family in LabelledView(registry, getattr(registry, "constant_labels", {})).collect():
                if family.name in merged:
                    merged[family.name].samples.extend(family.samples)
                else:
                    merged[family.name] = copy.copy(family)
                    merged[family.name].samples = list(family.samples)  # extended here, not the collector's
        yield from merged.values()


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
