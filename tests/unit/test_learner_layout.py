"""learner/ is laid out by concept with no import cycle anywhere, `TYPE_CHECKING` and function-level imports
counted, and nothing below the trainer imports it."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "learner"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def learner_modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imported(path: Path, known: set[str]) -> set[str]:
    """Every `learner.*` module that `path` imports, wherever the import stands (under `TYPE_CHECKING`, in a
    function): a `from learner.x import name` counts `learner.x.name` when that is a module."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("learner.")}
        elif (
            isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("learner")
        ):
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in known}
    return found


def import_graph() -> dict[str, set[str]]:
    """module -> the modules whose import it runs: the imported module and each package above it that is
    not a package of the importer itself (importing `learner.rl.step` runs `learner/rl/__init__.py`)."""
    modules = learner_modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        own = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 2)}
        edges = set()
        for target in imported(path, set(modules)):
            parts = target.split(".")
            for i in range(2, len(parts) + 1):
                dep = ".".join(parts[:i])
                if dep in modules and dep not in own and dep != name:
                    edges.add(dep)
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` (as a path that returns to its start), or None."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return [*stack[stack.index(dep) :], dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_cycle_anywhere_in_learner():
    graph = import_graph()
    assert "learner.rl.step" in graph and "learner.persist.sharded" in graph
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph) or [])}"


def test_the_cycle_finder_sees_a_cycle_through_a_package_init():
    # learner.batch importing learner.model.policy would run learner/model/__init__.py, which imports
    # learner.model.policy, which imports learner.batch (under TYPE_CHECKING): the test must catch that.
    graph = import_graph()
    graph["learner.batch"] = graph["learner.batch"] | {"learner.model", "learner.model.policy"}
    cycle = find_cycle(graph)
    assert cycle is not None and "learner.batch" in cycle


MAY_IMPORT = {  # docs/architecture.md's map: top-level part -> the parts of learner/ it may import
    "errors": set(),
    "metrics": set(),
    "correction": {"errors"},
    "config": {"correction"},
    "batch": {"errors"},
    "model": {"batch", "config"},
    "distributed": {"config", "errors", "model"},
    "build": {"config", "model", "distributed", "memory", "hostmem"},
    "rl": {"batch", "build", "config", "correction", "distributed", "errors", "metrics", "model"},
    "persist": {"build", "config", "distributed", "errors", "metrics", "model"},
    "delivery": {"metrics"},
    "memory": {"config", "errors"},
    "hostmem": set(),
    "tracking": {"config", "metrics"},
    "transport": {"config", "distributed", "model", "persist"},
    "resume_config": {"config"},
    "trainer": {
        "batch",
        "build",
        "config",
        "delivery",
        "distributed",
        "errors",
        "hostmem",
        "memory",
        "metrics",
        "model",
        "persist",
        "resume_config",
        "rl",
        "tracking",
        "transport",
    },
    "launch": {"config", "distributed", "model", "trainer"},
}


def part(module: str) -> str:
    return module.split(".")[1] if "." in module else module


def test_each_part_imports_only_what_the_map_allows():
    seen: dict[str, set[str]] = {}
    for module, deps in import_graph().items():
        if module != "learner":
            seen.setdefault(part(module), set()).update(part(d) for d in deps if part(d) != part(module))
    assert set(seen) == set(MAY_IMPORT)
    extra = {p: sorted(deps - MAY_IMPORT[p]) for p, deps in seen.items() if deps - MAY_IMPORT[p]}
    assert not extra, f"imports outside docs/architecture.md's map: {extra}"


def test_nothing_below_the_trainer_imports_it():
    importers = sorted(m for m, deps in import_graph().items() if "learner.trainer" in deps)
    assert importers == ["learner.launch"]


def test_at_most_twelve_top_level_modules():
    top = sorted(p.stem for p in PACKAGE.glob("*.py"))
    assert len(top) <= 12, top
    assert {"trainer", "launch", "build", "batch", "config", "errors", "delivery", "metrics"} <= set(top)


def test_subpackages_re_export_their_public_names():
    from learner import distributed, model, persist, rl, tracking
    from learner.distributed.gather import GatheredWeights
    from learner.model.policy import LogProbs
    from learner.persist.persistence import Persistence
    from learner.rl.step import train_on
    from learner.tracking.tracker import Tracker

    assert distributed.GatheredWeights is GatheredWeights and model.LogProbs is LogProbs
    assert persist.Persistence is Persistence and rl.train_on is train_on and tracking.Tracker is Tracker
    for package in (distributed, model, persist, rl, tracking):
        assert all(hasattr(package, name) for name in package.__all__), package.__name__
