"""learner/correction/ is one package without an import cycle, and its public names stay where they were."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[4] / "offpolicy" / "learner" / "correction"


def runtime_imports(path: Path) -> set[str]:
    """`offpolicy.learner.correction.*` modules imported when `path` runs (not under `if TYPE_CHECKING:`)."""
    found = set()
    for node in ast.walk(_strip_type_checking(path)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
            "offpolicy.learner.correction."
        ):
            found.add(node.module.rsplit(".", 1)[1])
    return found


def _strip_type_checking(path: Path) -> ast.Module:
    tree = ast.parse(path.read_text())
    tree.body = [
        n for n in tree.body if not (isinstance(n, ast.If) and getattr(n.test, "id", None) == "TYPE_CHECKING")
    ]
    return tree


def test_submodules_import_each_other_without_a_cycle():
    graph = {p.stem: runtime_imports(p) for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    assert set(graph) == {"thresholds", "presets", "config", "metrics", "rejection", "compute"}
    order = []
    while graph:
        ready = sorted(m for m, deps in graph.items() if deps <= set(order))
        assert ready, f"import cycle among {sorted(graph)}: {graph}"
        order += ready
        graph = {m: d for m, d in graph.items() if m not in ready}


def test_public_names_import_from_the_package():
    from offpolicy.learner.correction import RolloutCorrectionConfig, compute_rollout_correction
    from offpolicy.learner.correction.compute import compute_rollout_correction as compute
    from offpolicy.learner.correction.config import RolloutCorrectionConfig as Config

    assert compute_rollout_correction is compute and RolloutCorrectionConfig is Config
