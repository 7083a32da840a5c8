"""The five Grafana dashboards as code: `DASHBOARDS` in display order and `build_dashboard` (their JSON).

`panels.py` holds the model and the JSON builder; `training.py` the Overview, Off-policy correction and
Learner dashboards; `pipeline.py` the Buffer and Actors dashboards. `python deploy/render.py` writes them.
"""

from __future__ import annotations

from deploy.dashboards.panels import DashboardSpec, build_dashboard
from deploy.dashboards.pipeline import ACTORS, BUFFER
from deploy.dashboards.training import CORRECTION, LEARNER, OVERVIEW

DASHBOARDS: tuple[DashboardSpec, ...] = (OVERVIEW, CORRECTION, BUFFER, ACTORS, LEARNER)

__all__ = ["DASHBOARDS", "DashboardSpec", "build_dashboard"]
