"""No class under offpolicy/learner or offpolicy/actors inherits state from a mixin: a project base class
must define every `self.<name>` its methods read (assigned in its own methods, a method or property of its
own, a class attribute with a value, or so defined by a project base of its own). A bare annotation does
not define a name: it is how a mixin declares what it borrows. Protocols are not mixins."""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "offpolicy"


@dataclass
class ClassInfo:
    name: str
    module: Path
    bases: list[str]
    defined: set[str] = field(default_factory=set)
    read: set[str] = field(default_factory=set)


def base_name(node: ast.expr) -> str:
    if isinstance(node, ast.Subscript):
        node = node.value
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else ""


def targets(node: ast.expr):
    if isinstance(node, ast.Tuple | ast.List):
        for elt in node.elts:
            yield from targets(elt)
    elif isinstance(node, ast.Starred):
        yield from targets(node.value)
    else:
        yield node


def class_info(node: ast.ClassDef, module: Path) -> ClassInfo:
    info = ClassInfo(node.name, module, [base_name(b) for b in node.bases])
    for item in node.body:
        if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            info.defined.add(item.name)
        elif isinstance(item, ast.Assign):
            info.defined |= {t.id for tgt in item.targets for t in targets(tgt) if isinstance(t, ast.Name)}
        elif isinstance(item, ast.AnnAssign) and item.value is not None and isinstance(item.target, ast.Name):
            info.defined.add(item.target.id)
    for sub in ast.walk(node):
        if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "self":
            (info.defined if isinstance(sub.ctx, ast.Store | ast.Del) else info.read).add(sub.attr)
    return info


def project_classes(root: Path = PACKAGE) -> dict[str, list[ClassInfo]]:
    found: dict[str, list[ClassInfo]] = {}
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                found.setdefault(node.name, []).append(class_info(node, path))
    return found


def defines(info: ClassInfo, classes: dict[str, list[ClassInfo]], seen: frozenset = frozenset()) -> set[str]:
    """What `info` defines, with what its project bases define."""
    out = set(info.defined)
    for base in info.bases:
        for b in classes.get(base, []):
            if b.name not in seen:
                out |= defines(b, classes, seen | {info.name})
    return out


def borrowed(info: ClassInfo, classes: dict[str, list[ClassInfo]]) -> set[str]:
    """The names `info`'s methods read from `self` that neither it nor its project bases define."""
    if "Protocol" in info.bases:
        return set()
    return {n for n in info.read - defines(info, classes) if not n.startswith("__")}


def mixin_inheritance(scope: list[Path], classes: dict[str, list[ClassInfo]]) -> list[str]:
    """`Class(Base)` pairs in `scope` whose project base borrows state, with what it borrows."""
    bad = []
    for infos in classes.values():
        for info in infos:
            if not any(info.module.is_relative_to(s) for s in scope):
                continue
            for base in info.bases:
                for b in classes.get(base, []):
                    if names := borrowed(b, classes):
                        bad.append(f"{info.name}({b.name}) in {info.module.name}: {sorted(names)}")
    return bad


def test_no_class_in_the_learner_or_the_actors_inherits_state_from_a_mixin():
    classes = project_classes()
    assert mixin_inheritance([PACKAGE / "learner", PACKAGE / "actors"], classes) == []


def test_the_check_sees_a_mixin(tmp_path: Path):
    (tmp_path / "m.py").write_text(
        "from typing import Protocol\n"
        "class Borrowing:\n"
        "    config: dict\n"  # a bare annotation declares, it does not define
        "    def go(self):\n"
        "        return self.config, self.engine\n"
        "class Owning:\n"
        "    limit = 3\n"
        "    def __init__(self):\n"
        "        self.state = 0\n"
        "    def go(self):\n"
        "        return self.state, self.limit, self.go\n"
        "class Shape(Protocol):\n"
        "    def go(self):\n"
        "        return self.anything\n"
        "class A(Borrowing):\n"
        "    def __init__(self):\n"
        "        self.config, self.engine = {}, None\n"
        "class B(Owning, Shape):\n"
        "    pass\n"
    )
    classes = project_classes(tmp_path)
    assert mixin_inheritance([tmp_path], classes) == ["A(Borrowing) in m.py: ['config', 'engine']"]
