"""The project's vLLM plugin (`vllm.general_plugins` entry point `offpolicy`): registers the `gloo` and
`gloo_m2n` weight-transfer engine pairs in vLLM's factories, and where torchvision is missing lets the
Qwen2-VL family run on images (weights/processor.py). vLLM runs it in every process it starts (front end,
engine core, workers, its model inspection); it may run more than once per process, so it is idempotent."""

from __future__ import annotations

import os
import sys
from pathlib import Path

ENGINES = {
    "gloo": ("offpolicy.weights.engines.gloo", "GlooWeightTransferEngine", "GlooTrainerWeightTransferEngine"),
    "gloo_m2n": (
        "offpolicy.weights.engines.gloo_m2n",
        "GlooM2NWeightTransferEngine",
        "GlooM2NTrainerWeightTransferEngine",
    ),
}
"""Backend name -> (module, worker-side class, trainer-side class)."""


def register() -> None:
    """Register each of `ENGINES` (worker side and trainer side) unless it already is; apply
    `images_without_torchvision`."""
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    from offpolicy.weights.processor import images_without_torchvision

    for name, (module, worker, trainer) in ENGINES.items():
        if name not in WeightTransferEngineFactory._registry:
            WeightTransferEngineFactory.register_engine(name, module, worker)
        if name not in WeightTransferTrainerFactory._registry:
            WeightTransferTrainerFactory.register_engine(name, module, trainer)
    images_without_torchvision()


ENTRY_POINT = "offpolicy.weights.engines.plugin:register"


def expose_entry_point(folder: str | Path) -> bool:
    """Make the entry point visible to the processes vLLM starts from this one, where the installed package
    metadata predates it (a checkout installed before; `pip install -e .` makes this unnecessary): a
    dist-info declaring it is written under `folder`, which goes on PYTHONPATH (after this checkout's root)
    and `sys.path`. False when the installed metadata already declares it (nothing done)."""
    from importlib.metadata import entry_points

    if any(e.value == ENTRY_POINT for e in entry_points(group="vllm.general_plugins")):
        return False
    root = Path(folder)
    info = root / "offpolicy_vllm_plugin-0.0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: offpolicy-vllm-plugin\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text(f"[vllm.general_plugins]\noffpolicy = {ENTRY_POINT}\n")
    repo = str(Path(__file__).resolve().parents[3])
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([repo, str(root)] + ([old] if old else []))
    sys.path.insert(0, str(root))
    return True
