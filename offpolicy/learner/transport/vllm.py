"""`publish.transport: vllm`: the learner sends each version through one of vLLM's weight-transfer engines.

The learner is rank 0 of a transfer group (NCCL on GPUs, `gloo` for CPU tests) whose other ranks are the
inference workers of the live actors (weights/control.py: heartbeats in Redis). vLLM's trainer engine
(`WeightTransferTrainerFactory`) does the data plane; `FanoutClient` is its `VLLMWeightSyncClient`, which
carries the control calls to every member through Redis. At a version boundary `send(version)`:

1. reads the live members; when they differ from the group's (one joined, left or stopped beating), the
   group is torn down and formed again with them (a new epoch; each actor gets its rank offset);
2. sends: each member pauses its engine in place, receives, tags the version, resumes, and answers.

Every wait inside a send (the rendezvous, the collectives, the acks) is bounded by 0.6 x `transfer.timeout_s`,
and the whole send runs on a helper thread that the training step waits for at most `timeout_s`. A failure (a
member died mid-update, an answer missing or an error) tears the group down, is counted, and the learner
goes on training and writing file generations; members whose heartbeat count has not moved since are left
out of the next group until it moves again (a restarted actor has a new incarnation and joins afresh,
after it loaded the newest file generation).

A dying actor costs a heartbeat or two (and a resend when the broadcast broke early), not a step
(`weights.control.Liveness`: a member whose heartbeat record is gone or whose beat count has not moved for
1.25 x `heartbeat_s` is dead, seen within `Liveness.poll_s` while a send waits on it): the answers of a send
stop being awaited from dead members (an update the live ones confirmed is a success, the dead ones
`dropped`); when a member's death breaks the broadcast, the send waits for the update's answers (the survivors
that received every bucket confirm the version: they keep it) and sends again at once only to the survivors
that did not confirm it; a dead member is never admitted to a send. `dead_wait_s` of the result is what the
dead cost the step after the broadcast broke (finding them, sending again).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from offpolicy.learner.transport.address import check_bindable
from offpolicy.learner.transport.base import TransferResult
from offpolicy.learner.transport.fanout import FanoutClient, TransferFailed
from offpolicy.weights.control import Liveness

if TYPE_CHECKING:
    from offpolicy.weights.config import TransferConfig
    from offpolicy.weights.control import LearnerControl, Member
    from offpolicy.weights.engines.delta_rounds import DeltaSends

log = logging.getLogger(__name__)


def transfer_device(backend: str, local_rank: int) -> torch.device:
    """The device a backend sends from: this rank's GPU for NCCL (vLLM's communicators take the tensors and
    the current device there), the host for gloo."""
    return torch.device("cuda", local_rank) if backend.startswith("nccl") else torch.device("cpu")


def bind_thread(device: torch.device) -> None:
    """Make `device` the calling thread's current CUDA device (it is per thread, 0 in a new one): the
    transfer runs on a helper thread, and vLLM forms its NCCL groups on the current device."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def _weight_source(state: Callable[[], dict[str, torch.Tensor]], dtype: torch.dtype, device: torch.device):
    """A vLLM `WeightSource` over the learner's weights (a fresh `state()` each pass), floating tensors cast
    to the publish dtype (what the file generations hold), each moved to `device` as it is sent: the rank's
    GPU for NCCL, whose broadcast refuses host tensors (on N ranks the state is the gathered host copy),
    the host for gloo."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource, materialize_full_tensor

    def wire(t: torch.Tensor) -> torch.dtype:
        return dtype if t.is_floating_point() else t.dtype

    class StateSource(WeightSource):
        def metadata(self) -> list[ParamMeta]:
            return [ParamMeta(n, wire(t), tuple(t.shape)) for n, t in state().items()]

        def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
            for name, t in state().items():
                full = materialize_full_tensor(t.detach())
                yield name, full.to(device=device, dtype=wire(t), non_blocking=False)

    return StateSource()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class VllmTransport:
    """The learner's side of `publish.transport: vllm` (one process: the learner is the only sender)."""

    name = "vllm"
    delta: DeltaSends | None = None  # `publish.delta`'s rounds (gloo); the m2n subclass sends whole

    def __init__(
        self,
        config: TransferConfig,
        control: LearnerControl,
        state: Callable[[], dict[str, torch.Tensor]],
        dtype: torch.dtype,
        local_rank: int = 0,
        delta: DeltaSends | None = None,
    ) -> None:
        self.config, self.control = config, control
        # `publish.delta`: rounds sent as their changes where the backend's engine applies them (gloo);
        # the base it keeps lives here, across the groups (a new group's first round is whole)
        self.delta = delta if config.backend == "gloo" else None
        if delta is not None and self.delta is None:
            log.warning(
                "publish.delta: transfer.backend %s sends every version whole (deltas through the engines "
                "are built for gloo); the file generations are deltas",
                config.backend,
            )
        self.liveness = Liveness(1.25 * config.heartbeat_s)
        self.device = transfer_device(config.backend, local_rank)
        self.source = _weight_source(state, dtype, self.device)
        check_bindable(config.address)  # at start, not as every send's logged failure
        _trainer_init_info(config, config.address, 0, 1)  # imports (and registers) now, not in a send's bound
        self._init_group_state()

    def _init_group_state(self) -> None:
        """No group yet, no member benched or stalled, no send made."""
        self.engine = None
        self.client: FanoutClient | None = None
        self.epoch = 0
        self._stalled: dict[str, int] = {}  # actor id -> heartbeat count at the last failure
        self._benched: dict[str, tuple[str, int, int]] = {}  # id -> (incarnation, until send no., strikes)
        self._sends = 0
        self._thread: threading.Thread | None = None  # a send that outlived its bound, still unwinding
        self._closing: threading.Thread | None = None  # a teardown that outlived its bound, still closing
        self.stuck = 0  # sends and teardowns that outlived their bound (a hung rendezvous, collective, sync)
        self._broken: FanoutClient | None = None  # the group of the last failed send, if it formed
        self.last_retry: tuple[float, float, int] | None = None  # a broken send's: find s, resend s, resent

    @property
    def busy(self) -> bool:
        """A send or a group's teardown that outlived its bound is still unwinding (the next `send` fails at
        once until it ends; the actors go on with file generations)."""
        return any(t is not None and t.is_alive() for t in (self._thread, self._closing))

    @property
    def group_size(self) -> int:
        return 0 if self.client is None else len(self.client.members)

    def send(self, version: int) -> TransferResult:
        """Send `version` to the live members; never waits longer than `timeout_s` (+ one Redis read), and
        a member that dies in it costs at most its lapse (`Liveness`) and a send to the survivors."""
        if self.busy:  # the last one is still unwinding
            return TransferResult(version, 0.0, ok=False, error="the previous send is still unwinding")
        self._sends += 1
        live = self.control.members()
        self.liveness.observe(live)
        members = [m for m in live if self._admitted(m) and not self.liveness.stopped(m)]
        for m in members:  # beating again (or restarted): back in
            self._stalled.pop(m.actor_id, None)
        first = self._send_to(version, members)
        if first.ok or not members or self.busy:
            return first
        t0 = time.perf_counter()  # the send broke: was it a member's death? then once more to the others
        broken, self._broken = self._broken, None  # the failed send's group (torn down), if it formed
        held = broken.holders(_inner(self.config)) if broken is not None else set()
        dead = self._find_dead([m.actor_id for m in members if m.actor_id not in held])
        found = time.perf_counter() - t0
        survivors = [m for m in members if m.actor_id not in dead]
        if not dead or not survivors:
            return first
        for m in survivors:  # the broken group stalled them all: the living ones are not to blame
            self._stalled.pop(m.actor_id, None)
        todo = [m for m in survivors if m.actor_id not in held]  # who confirmed the version keeps it
        log.warning("v%d: %s died in the send; %d survivor(s) hold it, sending again to %d", version,
                    sorted(dead), len(survivors) - len(todo), len(todo))  # fmt: skip
        again = self._send_to(version, todo)
        spent = time.perf_counter() - t0
        self.last_retry = (found, spent - found, len(todo))
        return TransferResult(
            version, first.seconds + spent, first.bytes + again.bytes, len(survivors), again.ok, again.error,
            tuple(sorted(dead | set(again.dropped))), spent,
        )  # fmt: skip

    def _find_dead(self, ids: list[str]) -> set[str]:
        """Of `ids`, those whose heartbeats stopped, waiting at most one lapse for them to show it."""
        deadline = time.monotonic() + self.liveness.lapse_s + 0.1
        while True:
            dead = self.liveness.dead(self.control.members(), ids)
            if dead or time.monotonic() >= deadline:
                return dead
            time.sleep(self.liveness.poll_s)

    def _send_to(self, version: int, members: list[Member]) -> TransferResult:
        """One send of `version` to `members` (the group formed again when they changed)."""
        t0 = time.perf_counter()
        if not members:
            self._teardown()
            return TransferResult(version, 0.0, group_size=0)
        outcome: dict[str, Any] = {}
        self._thread = threading.Thread(
            target=self._run, args=(version, members, outcome), name="offpolicy-transfer", daemon=True
        )
        self._thread.start()
        self._thread.join(self.config.timeout_s)
        seconds = time.perf_counter() - t0
        if self._thread.is_alive():  # stuck: it ends in the background, sends fail at once until then
            self.stuck += 1
            error = f"no result in {self.config.timeout_s:g} s"
        else:
            error = outcome.get("error", "")
        if error:
            self._broken = outcome.get("client")
            self._failed(members, outcome.get("culprits"))
            log.warning("weight transfer of v%d failed after %.2f s: %s", version, seconds, error)
            return TransferResult(version, seconds, outcome.get("bytes", 0), len(members), False, error)
        for m in members:  # a clean send clears past strikes
            self._benched.pop(m.actor_id, None)
        dropped = tuple(sorted(self.client.dropped)) if self.client is not None else ()
        if dropped:  # confirmed by the others; the dead leave the group before the next send
            log.warning("v%d: %s died during the send; the %d other(s) confirmed it", version, list(dropped),
                        len(members) - len(dropped))  # fmt: skip
            self._teardown()
        d = self.delta
        full = d.last_full_bytes if d is not None and d.last_kind == "delta" else 0
        return TransferResult(
            version, seconds, outcome["bytes"], len(members), dropped=dropped, full_bytes=full
        )

    def _admitted(self, m: Member) -> bool:
        """Whether a live member goes into this send's group: not stalled since a failure (its heartbeat
        count has moved or it restarted) and not benched (an actor named by a failed command sits out
        1, 2, 4, ... up to 16 sends, unless it restarted: a new incarnation comes in at once)."""
        if self._stalled.get(m.actor_id) == m.beats:
            return False
        benched = self._benched.get(m.actor_id)
        return benched is None or benched[0] != m.incarnation or self._sends >= benched[1]

    def _run(self, version: int, members: list[Member], outcome: dict[str, Any]) -> None:
        changed = self.client is None or [(m.actor_id, m.incarnation) for m in self.client.members] != [
            (m.actor_id, m.incarnation) for m in members
        ]
        self._attempt(version, outcome, (lambda: self._form(members)) if changed else None)

    def _attempt(self, version: int, outcome: dict[str, Any], form: Callable[[], None] | None) -> None:
        """Form the group first when `form` is given, then send `version`; the outcome (bytes, or the
        error and the members it names) goes into `outcome`, never raised into the step."""
        try:
            bind_thread(self.device)  # this runs on the transfer thread: its current device is its own
            if form is not None:
                form()
            assert self.engine is not None
            if self.client is not None:  # the controller (on N ranks, rank 0 only)
                self.client.version = version
                self.client.dropped, self.client.held = set(), set()
                outcome["client"] = self.client
            self.engine.send_weights()
            outcome["bytes"] = getattr(self.engine, "bytes_sent", 0)
        except Exception as e:  # translated: reported as a failed transfer, never raised into the step
            outcome["bytes"] = getattr(self.engine, "bytes_sent", 0)  # what went out before it broke
            outcome["error"] = f"{type(e).__name__}: {e}"
            outcome["culprits"] = e.culprits if isinstance(e, TransferFailed) else None

    def _form(self, members: list[Member]) -> None:
        """Tear the old group down and form one with `members` (a new epoch)."""
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        self._teardown()
        self.epoch += 1
        cfg = self.config
        client = FanoutClient(self.control, members, self.epoch, _inner(cfg), self.liveness)
        port = cfg.port or _free_port()
        world = 1 + sum(m.workers for m in members)
        info = _trainer_init_info(cfg, cfg.address, port, world)
        self.engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=self.source)
        if self.delta is not None:
            self.engine.delta = self.delta
        self.client = client
        log.info("transfer group epoch %d formed: %s (%d ranks)", self.epoch, client.ids, world)

    def _failed(self, members: list[Member], culprits: list[str] | None) -> None:
        """After a failed send: the members named by the failure are benched; when the failure names no one
        (the broadcast broke: a peer died), every member sits out until its heartbeat moves again."""
        if culprits:
            for m in members:
                if m.actor_id in culprits:
                    strikes = self._benched.get(m.actor_id, ("", 0, 0))[2] + 1
                    until = self._sends + 1 + min(2 ** (strikes - 1), 16)
                    self._benched[m.actor_id] = (m.incarnation, until, strikes)
        else:
            self._stalled.update({m.actor_id: m.beats for m in members})
        self._teardown()

    def _teardown(self) -> None:
        """Close the group, bounded: vLLM's shutdown (NCCL's synchronizes the device before it aborts the
        communicator, and may hang behind a collective that never completes) and the members' `leave` run
        on a helper thread that the caller (the training thread, after a failed send) waits for at most
        `_inner(timeout_s)`. Past it the teardown is counted as stuck (`stuck`, the learner's
        `offpolicy_learner_transfer_stuck_total`, `/v1/status`), logged, and left to end in the background:
        until it does, sends fail at once (`busy`) and the actors go on with file generations."""
        engine, client, self.engine, self.client = self.engine, self.client, None, None
        if self.delta is not None:
            self.delta.drop()  # the next group's first round is whole
        if engine is None and client is None:
            return

        def close() -> None:
            if engine is not None:
                try:
                    engine.shutdown()  # closes the group: members still receiving fail at once
                except Exception as e:  # translated: a broken group may not shut down cleanly
                    log.warning("transfer group shutdown: %s", e)
            if client is not None:
                client.leave()

        closing = threading.Thread(target=close, name="offpolicy-transfer-teardown", daemon=True)
        closing.start()
        closing.join(_inner(self.config))
        if closing.is_alive():
            self.stuck += 1
            self._closing = closing
            log.error(
                "the transfer group's teardown did not end in %.0f s (a hung collective or device sync): "
                "sends fail at once until it does; the actors go on with file generations",
                _inner(self.config),
            )

    def close(self) -> None:
        self._teardown()
        self.control.close()


def _inner(cfg: TransferConfig) -> float:
    """The bound of each wait inside a send (rendezvous, collective, answers): shorter than the send's own
    bound, so that a member that does not answer is named (and benched) before the send gives up."""
    return 0.6 * cfg.timeout_s  # the rendezvous store overshoots its timeout by up to ~1 s


def _trainer_init_info(cfg: TransferConfig, address: str, port: int, world: int):
    """vLLM's trainer init info for `cfg.backend` (the learner is rank 0, the only sender)."""
    if cfg.backend == "gloo":
        from offpolicy.weights.engines.gloo import GlooTrainerInitInfo
        from offpolicy.weights.engines.plugin import register

        register()
        return GlooTrainerInitInfo(
            rank=0,
            master_address=address,
            master_port=port,
            world_size=world,
            packed_buffer_size_bytes=cfg.bucket_bytes,
            timeout_s=_inner(cfg),
        )
    if cfg.backend == "nccl":
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        return NCCLTrainerInitInfo(
            rank=0,
            master_address=address,
            master_port=port,
            world_size=world,
            packed_buffer_size_bytes=cfg.bucket_bytes,
        )
    raise ValueError(f"transfer.backend {cfg.backend!r} is not supported by the learner")
