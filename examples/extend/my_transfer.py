"""A weight-transfer backend of your own: an engine pair registered in vLLM's weight-transfer factories
(docs/extend.md "A transfer backend").

With `publish.transport: vllm` / `reload.transport: vllm` the learner sends each version through one of
vLLM's weight-transfer engines: a trainer-side engine in the learner (`WeightTransferTrainerFactory`) and a
worker-side engine in every inference worker of every actor (`WeightTransferEngineFactory`), both looked
up by the backend's name. The project registers its own pairs (`gloo`, `gloo_m2n`) from its vLLM plugin,
`offpolicy.weights.engines.plugin:register` (the `vllm.general_plugins` entry point, which vLLM runs in
every process it starts). A pair of yours is registered the same way, from a plugin of your own package:

    [project.entry-points."vllm.general_plugins"]
    my_transfer = "my_transfer:register"

The pair below is the project's gloo pair under another name: the wiring, not a new wire. Start from
`offpolicy/weights/engines/gloo.py` (one module, both sides, vLLM's `nccl_engine.py` shape) and replace
`trainer_init` / `send_weights` and `init_transfer_engine` / `receive_weights` with your transport.

Registering is not enough: the learner and the actors accept only the backends `TransferConfig.backend`
lists, and the learner builds each backend's trainer init info itself. docs/extend.md names the places to
edit; `demo()` shows where the package stops today.

    python examples/extend/my_transfer.py    # registers the pair, looks it up in vLLM's factories
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from offpolicy.weights.engines.gloo import (
    GlooTrainerInitInfo,
    GlooTrainerWeightTransferEngine,
    GlooWeightTransferEngine,
)

BACKEND = "my_gloo"
"""The name in vLLM's factories, in `publish.transfer.backend` and `reload.transfer.backend` (once
`TransferConfig` lists it)."""


@dataclass
class MyTrainerInitInfo(GlooTrainerInitInfo):
    """vLLM's trainer factory picks the engine by `init_info.backend` (a ClassVar per init-info class)."""

    backend: ClassVar[str] = BACKEND


class MyTrainerWeightTransferEngine(GlooTrainerWeightTransferEngine):
    """The learner's side: `trainer_init` forms the group, `send_weights` sends one version."""

    init_info_cls = MyTrainerInitInfo


class MyWeightTransferEngine(GlooWeightTransferEngine):
    """An inference worker's side: `init_transfer_engine` joins the group, `receive_weights` loads one
    version (inside vLLM's layerwise-reload lifecycle)."""


def register() -> None:
    """The vLLM plugin: register both sides unless they already are (vLLM may run a plugin more than once
    in one process, and runs it in every process it starts)."""
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, MyWeightTransferEngine)
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, MyTrainerWeightTransferEngine)


def demo() -> tuple[type, type, str]:
    """Register (twice: idempotent), then what vLLM's factories resolve the name to, and what the
    package's `TransferConfig` says about it."""
    from pydantic import ValidationError
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    from offpolicy.weights.config import TransferConfig

    register()
    register()
    worker = WeightTransferEngineFactory._registry[BACKEND]()
    trainer = WeightTransferTrainerFactory._registry[BACKEND]()
    try:
        TransferConfig(backend=BACKEND)
        verdict = "accepted"
    except ValidationError as e:
        verdict = f"refused: {e.errors()[0]['msg']}"
    return worker, trainer, verdict


if __name__ == "__main__":
    worker, trainer, verdict = demo()
    print(f"vLLM's factories: {BACKEND!r} -> worker {worker.__name__}, trainer {trainer.__name__}")
    print(f"offpolicy's TransferConfig(backend={BACKEND!r}): {verdict}")
