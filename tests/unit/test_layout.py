"""The whole house's layout: one top-level package, each package imports only what the map allows, no import
cycle anywhere (`TYPE_CHECKING` and function-level imports counted), the learner and the actors never import
each other, HTTP only in services/, no torch in buffer/."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "offpolicy"

# docs/architecture.md's map: package -> the packages it may import (imports go down only)
MAY_IMPORT = {
    "config": set(),
    "buffer": {"config"},
    "weights": {"config", "buffer"},
    "learner": {"config", "buffer", "weights"},
    "actors": {"config", "buffer", "weights"},
    "services": {"config", "buffer", "weights", "learner", "actors"},
}

# inside learner/ and actors/: top-level part -> the parts of the same package it may import
LEARNER_PARTS = {
    "errors": set(),
    "metrics": set(),
    "correction": {"errors"},
    "config": {"correction"},
    "batch": {"errors"},
    "model": {"batch", "config", "errors"},
    "distributed": {"config", "errors", "model"},
    "build": {"config", "model", "distributed", "plan"},
    "rl": {"batch", "build", "config", "correction", "distributed", "errors", "metrics", "model"},
    "persist": {"build", "config", "distributed", "errors", "metrics", "model"},
    "delivery": {"metrics"},
    "intake": {"config", "delivery", "metrics", "rl"},
    "control": {"config"},
    "loop": {"config", "distributed", "errors", "persist"},
    "durability": {"config", "delivery", "distributed", "errors", "metrics"},
    "reconfigure": {"build", "config", "distributed", "errors", "metrics", "tracking"},
    "plan": {"config", "errors"},
    "tracking": {"config", "metrics"},
    "transport": {"config", "distributed", "model", "persist"},
    "trainer": {
        "batch",
        "build",
        "config",
        "control",
        "delivery",
        "distributed",
        "durability",
        "errors",
        "intake",
        "loop",
        "plan",
        "reconfigure",
        "metrics",
        "model",
        "persist",
        "rl",
        "tracking",
        "transport",
    },
    "launch": {"config", "distributed", "model", "trainer"},
}
ACTOR_PARTS = {
    "errors": set(),
    "metrics": set(),
    "config": set(),
    "engine": {"config", "errors"},
    "data": {"config", "errors", "engine", "rollout"},
    "rollout": {"config", "data", "engine", "errors", "gateway", "metrics", "transport"},
    "gateway": {"config", "data", "engine", "errors", "metrics", "rollout"},
    # rollout -> gateway: the actor hosts the gateway, which sees it only through a Protocol (GatewayHost)
    "transport": {"config", "engine", "errors", "metrics"},
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports_of(path: Path) -> set[str]:
    """Every absolute import of `path`, wherever it stands: `from a.b import c` gives `a.b` and `a.b.c`."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return found


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules whose import it runs: the imported module and each package above it that
    is not a package of the importer itself (importing `offpolicy.learner.rl.step` runs `rl/__init__.py`)."""
    known = modules()
    graph: dict[str, set[str]] = {}
    for name, path in known.items():
        own = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 2)}
        edges = set()
        for target in imports_of(path):
            parts = target.split(".")
            for i in range(2, len(parts) + 1):
                dep = ".".join(parts[:i])
                if dep in known and dep not in own and dep != name:
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


def package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def part(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 else None


def test_one_top_level_package_is_installed():
    doc = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert doc["tool"]["setuptools"]["packages"]["find"]["include"] == ["offpolicy*"]
    assert doc["project"]["scripts"]["offpolicy"].startswith("offpolicy.")
    assert all(
        v.startswith("offpolicy.") for v in doc["project"]["entry-points"]["vllm.general_plugins"].values()
    )
    top = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    assert top == {"offpolicy", "tests"}, top
    assert {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"} == set(MAY_IMPORT)


def test_no_import_cycle_anywhere():
    graph = import_graph()
    assert "offpolicy.learner.rl.step" in graph and "offpolicy.actors.rollout.actor" in graph
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph) or [])}"


def test_the_cycle_finder_sees_a_cycle_through_a_package_init():
    # learner.batch importing learner.model.policy would run learner/model/__init__.py, which imports
    # learner.model.policy, which imports learner.batch (under TYPE_CHECKING): the test must catch that.
    graph = import_graph()
    batch = "offpolicy.learner.batch"
    graph[batch] = graph[batch] | {"offpolicy.learner.model", "offpolicy.learner.model.policy"}
    cycle = find_cycle(graph)
    assert cycle is not None and batch in cycle


def package_violations(graph: dict[str, set[str]]) -> dict[str, list[str]]:
    """package -> the packages it imports outside the map."""
    seen: dict[str, set[str]] = {p: set() for p in MAY_IMPORT}
    for module, deps in graph.items():
        if module != "offpolicy":
            seen[package(module)] |= {package(d) for d in deps if d != "offpolicy"} - {package(module)}
    return {p: sorted(deps - MAY_IMPORT[p]) for p, deps in seen.items() if deps - MAY_IMPORT[p]}


def test_each_package_imports_only_what_the_map_allows():
    extra = package_violations(import_graph())
    assert not extra, f"imports outside docs/architecture.md's map: {extra}"


def test_the_map_check_sees_a_learner_importing_the_actors():
    graph = import_graph()
    graph["offpolicy.learner.transport.vllm"].add("offpolicy.actors.transport.receiver")
    assert package_violations(graph) == {"learner": ["actors"]}


def parts_seen(pkg: str) -> dict[str, set[str]]:
    seen: dict[str, set[str]] = {}
    for module, deps in import_graph().items():
        if package(module) != pkg or part(module) is None:
            continue
        own = part(module)
        seen.setdefault(own, set()).update(
            p for d in deps if package(d) == pkg and (p := part(d)) is not None and p != own
        )
    return seen


def test_each_part_of_the_learner_and_the_actors_imports_only_what_its_map_allows():
    for pkg, allowed in (("learner", LEARNER_PARTS), ("actors", ACTOR_PARTS)):
        seen = parts_seen(pkg)
        assert set(seen) == set(allowed), (pkg, sorted(set(seen) ^ set(allowed)))
        extra = {p: sorted(deps - allowed[p]) for p, deps in seen.items() if deps - allowed[p]}
        assert not extra, f"{pkg}: imports outside the map: {extra}"


def test_nothing_below_the_trainer_imports_it():
    importers = sorted(m for m, deps in import_graph().items() if "offpolicy.learner.trainer" in deps)
    assert importers == [
        "offpolicy.learner.launch",
        *sorted(m for m in importers if package(m) == "services"),
    ]


def test_http_only_in_services_and_no_torch_in_the_buffer():
    for name, path in modules().items():
        roots = {i.split(".")[0] for i in imports_of(path)}
        if package(name) != "services" if name != "offpolicy" else False:
            assert not roots & {"fastapi", "starlette", "uvicorn"}, name
        if name.startswith("offpolicy.buffer") or name.startswith("offpolicy.config"):
            assert "torch" not in roots, name


def test_at_most_twelve_top_level_modules_per_package():
    for pkg in ("learner", "actors"):
        top = sorted(p.stem for p in (PACKAGE / pkg).glob("*.py"))
        assert len(top) <= 12, (pkg, top)
    learner = {p.stem for p in (PACKAGE / "learner").glob("*.py")} | {
        p.name for p in (PACKAGE / "learner").iterdir() if (p / "__init__.py").is_file()
    }
    assert {"trainer", "launch", "build", "batch", "config", "errors", "delivery", "metrics"} <= learner


def test_subpackages_re_export_their_public_names():
    from offpolicy.learner import distributed, model, persist, rl, tracking
    from offpolicy.learner.distributed.gather import GatheredWeights
    from offpolicy.learner.model.policy import LogProbs
    from offpolicy.learner.persist.durable_writes import Persistence
    from offpolicy.learner.rl.step import train_on
    from offpolicy.learner.tracking.tracker import Tracker

    assert distributed.GatheredWeights is GatheredWeights and model.LogProbs is LogProbs
    assert persist.Persistence is Persistence and rl.train_on is train_on and tracking.Tracker is Tracker
    for pkg in (distributed, model, persist, rl, tracking):
        assert all(hasattr(pkg, name) for name in pkg.__all__), pkg.__name__


def test_the_checkout_root_is_found_from_inside_the_package():
    # services start children with the checkout's root on PYTHONPATH and as their cwd: a root one folder
    # too deep (offpolicy/) would put the package's own `config` first on the children's sys.path
    from offpolicy.services import children
    from offpolicy.services.cli import bench as cli

    assert children.REPO_ROOT == ROOT and cli.REPO_ROOT == ROOT
