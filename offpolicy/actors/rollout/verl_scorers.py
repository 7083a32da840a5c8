"""verl's reward scorers without Ray: `from verl.utils.reward_score import gsm8k` in a user's reward module.

`verl/__init__.py` imports its data protocol (Ray, tensordict) and `verl/utils/__init__.py` its config and
tokenizer helpers (OmegaConf), though the scorers under `verl.utils.reward_score` need neither (gsm8k,
math_reward and math_dapo need the standard library; geo3k, prime_math and the sandbox ones name their
own packages). An actor image has vLLM, not verl's training stack: `pip install --no-deps verl==0.9.1`
(the images' `REWARD_PACKAGES_NO_DEPS` build argument) puts verl's sources there, and a reward module
whose import failed inside verl is imported once more with `verl` and `verl.utils` as bare packages over
those same folders (their `__init__` not run). A reward that needs more of verl than its scorers still
fails, naming the module verl could not import.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import traceback
import types
from pathlib import Path
from typing import Any

BARE = ("verl", "verl.utils")
"""The packages whose `__init__` the scorers do not need, made bare."""


def _verl_folder() -> Path | None:
    """Where the installed verl's sources are, found without importing it (None: not installed)."""
    try:
        spec = importlib.util.find_spec("verl")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _raised_inside(error: BaseException, folder: Path) -> bool:
    """Whether the import failed in a file under `folder` (verl's own imports, not the user's)."""
    frames = traceback.extract_tb(error.__traceback__)
    return any(Path(frame.filename).is_relative_to(folder) for frame in frames)


def bare_verl(folder: Path) -> None:
    """`verl` and `verl.utils` as packages over `folder`'s sources without their `__init__`; what a failed
    import left of verl in `sys.modules` goes first."""
    for name in [m for m in sys.modules if m == "verl" or m.startswith("verl.")]:
        del sys.modules[name]
    for name in BARE:
        package = types.ModuleType(name, f"verl's sources at {folder}, bare: offpolicy's scorers without Ray")
        package.__path__ = [str(folder.joinpath(*name.split(".")[1:]))]
        package.__offpolicy_bare__ = True
        sys.modules[name] = package
    sys.modules["verl"].utils = sys.modules["verl.utils"]


def import_reward_module(name: str) -> Any:
    """`importlib.import_module(name)`; when that failed inside an installed verl (Ray, OmegaConf missing),
    once more over a bare verl. The second failure is raised with what verl lacked."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        folder = _verl_folder()
        if folder is None or not _raised_inside(e, folder) or _is_bare():
            raise
        first = e
    bare_verl(folder)
    try:
        return importlib.import_module(name)
    except ImportError as e:
        lacked = first.name or first
        raise ImportError(
            f"{e} (verl's package needs {lacked}; its scorers under verl.utils.reward_score load without "
            "it, this module needs more of verl: install verl with its dependencies)"
        ) from e


def _is_bare() -> bool:
    """Whether `verl` is already the bare package (a second try would fail the same way)."""
    return bool(getattr(sys.modules.get("verl"), "__offpolicy_bare__", False))
