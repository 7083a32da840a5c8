"""Load verl 0.9.1's own rollout-correction and loss code as a test oracle and benchmark baseline.

verl is installed with `pip install --no-deps verl==0.9.1` (see the Makefile): its package `__init__`
needs ray, tensordict, omegaconf and more, none of which `rollout_corr_helper.py`, `core_algos.agg_loss`
or `compute_policy_loss_vanilla` use at run time. This module executes those two source files under
their real module names with tiny stand-ins for the heavy imports, then takes the stand-ins out of
`sys.modules` again, so nothing else in the process sees a fake `verl`. Returns None when verl is not
installed.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True)
class VerlOracle:
    """verl's modules, loaded from the installed wheel."""

    helper: types.ModuleType  # verl/trainer/ppo/rollout_corr_helper.py
    core_algos: types.ModuleType  # verl/trainer/ppo/core_algos.py
    verl_f: types.ModuleType  # verl/utils/torch_functional.py


class _DataProto:
    """Stand-in for verl.protocol.DataProto: only `from_dict(tensors=...)` and `.batch` are used."""

    def __init__(self, batch: dict[str, torch.Tensor]) -> None:
        self.batch = batch

    @classmethod
    def from_dict(cls, tensors: dict[str, torch.Tensor]) -> _DataProto:
        return cls(dict(tensors))


def _module(name: str, **attrs: Any) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__path__ = []  # a package, so that submodules can be registered under it
    for key, value in attrs.items():
        setattr(mod, key, value)
    return mod


def _stubs() -> dict[str, types.ModuleType]:
    identity_decorator = lambda *a, **k: lambda fn: fn  # noqa: E731
    placeholder = type("Placeholder", (), {})
    return {
        "verl": _module("verl"),
        "verl.utils": _module("verl.utils", as_torch_index=None, group_mean_std=None),
        "verl.utils.device": _module(
            "verl.utils.device", get_device_name=lambda: "cpu", get_torch_device=lambda: torch.cpu
        ),
        "verl.utils.import_utils": _module("verl.utils.import_utils", deprecated=identity_decorator),
        "verl.protocol": _module("verl.protocol", DataProto=_DataProto),
        "verl.trainer": _module("verl.trainer"),
        "verl.trainer.ppo": _module("verl.trainer.ppo"),
        "verl.trainer.config": _module("verl.trainer.config", AlgoConfig=placeholder),
        "verl.trainer.config.algorithm": _module(
            "verl.trainer.config.algorithm", RolloutCorrectionConfig=placeholder
        ),
        "verl.workers": _module("verl.workers"),
        "verl.workers.config": _module("verl.workers.config", ActorConfig=placeholder),
        "verl.workers.config.actor": _module("verl.workers.config.actor", PolicyLossConfig=placeholder),
        "tensordict": _module("tensordict", TensorDict=placeholder),
        "omegaconf": _module("omegaconf", DictConfig=placeholder, open_dict=None),
    }


def _exec(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def load_verl() -> VerlOracle | None:
    """verl 0.9.1's helper, core_algos and torch_functional, or None if the wheel is not installed."""
    try:
        dist = importlib.metadata.distribution("verl")
    except importlib.metadata.PackageNotFoundError:
        return None
    if dist.version != "0.9.1":
        return None
    root = Path(str(dist.locate_file("verl")))
    stubs = _stubs()
    names = [
        *stubs,
        "verl.utils.torch_functional",
        "verl.trainer.ppo.rollout_corr_helper",
        "verl.trainer.ppo.core_algos",
    ]
    saved = {name: sys.modules.get(name) for name in names}
    try:
        sys.modules.update(stubs)
        verl_f = _exec("verl.utils.torch_functional", root / "utils" / "torch_functional.py")
        helper = _exec(
            "verl.trainer.ppo.rollout_corr_helper", root / "trainer" / "ppo" / "rollout_corr_helper.py"
        )
        core = _exec("verl.trainer.ppo.core_algos", root / "trainer" / "ppo" / "core_algos.py")
    finally:
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old
    return VerlOracle(helper=helper, core_algos=core, verl_f=verl_f)
