"""Mixture-of-experts policies: which models are MoE, how their experts run, and the router's losses.

transformers 5 holds a sparse block's experts fused, as 3-D parameters (`mlp.experts.gate_up_proj`
(E, 2I, H), `mlp.experts.down_proj` (E, H, I)) beside a router (`mlp.gate`, logits (T, E)); Qwen3-MoE,
Qwen2-MoE, Mixtral and DeepSeek-V2/V3 share that layout. The experts run as grouped GEMMs
(transformers' `grouped_mm` experts implementation: tokens sorted by expert, one `torch.nn.functional.
grouped_mm` per projection) on every device where this torch has the kernel; on CUDA nothing else is
accepted (`select_experts`), since the other implementation (`eager`) is a Python loop over experts.

The router's losses (`router_losses`) are computed from the router logits of the policy's own training
forward, captured by `RouterLogits` (forward hooks that keep a reference to each router's logits: no
computation inside the decoder layers, so activation checkpointing recomputes them unchanged):
- load balancing (Switch Transformer, as transformers' `load_balancing_loss_func`): E x sum_e f_e P_e
  over every layer's tokens, f_e the share of top-k assignments to expert e, P_e its mean router
  probability;
- router z-loss (ST-MoE): the mean over layers and tokens of logsumexp(logits)^2.
Names of published weights: learner/model/moe_names.py.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from offpolicy.learner.config.moe import MoeConfig

log = logging.getLogger(__name__)

REPLAYABLE = frozenset({"qwen3_moe", "qwen2_moe", "mixtral"})  # softmax top-k routers (routing replay)
_EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts")


def num_experts(config: Any) -> int:
    """The routed experts per sparse block of a transformers config; 0 for a dense model."""
    for key in _EXPERT_COUNTS:
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return 0


def is_moe(config: Any) -> bool:
    """Whether a transformers config describes a mixture-of-experts model (routed experts > 0)."""
    return num_experts(config) > 0


def experts_per_token(config: Any) -> int:
    """k of the top-k routing (`num_experts_per_tok`)."""
    return int(config.num_experts_per_tok)


def select_experts(model: nn.Module, device: torch.device) -> str:
    """Run `model`'s experts as grouped GEMMs (transformers' `grouped_mm`) and return the implementation
    in use. On CUDA a model that cannot (a torch without `grouped_mm`, a GPU below SM80) is refused: the
    only other implementation is a Python loop over experts. Elsewhere (CPU) `eager` is accepted, logged,
    when `grouped_mm` cannot dispatch. A dense model is returned as it is (`dense`)."""
    if not is_moe(model.config):
        return "dense"
    try:
        model.set_experts_implementation("grouped_mm")
    except (ValueError, ImportError, RuntimeError) as exc:
        if device.type == "cuda":
            raise ValueError(
                f"{type(model).__name__}: the experts cannot run as grouped GEMMs on {device} ({exc}); the "
                "learner refuses the per-expert Python loop on CUDA: use torch >= 2.10 on an SM80+ GPU"
            ) from exc
        model.set_experts_implementation("eager")
        log.warning("experts run as a per-expert loop on %s: grouped_mm cannot dispatch (%s)", device, exc)
    used = model.config._experts_implementation
    if device.type == "cuda" and used != "grouped_mm":
        raise ValueError(f"experts implementation {used!r} on CUDA: the learner needs grouped_mm")
    return used


def prepare(model: nn.Module, device: torch.device, cfg: MoeConfig, path: Any) -> RouterLogits | None:
    """The policy side of an MoE model at build time: its experts as grouped GEMMs (`select_experts`)
    and its routers' logits hooked (`RouterLogits`) for the `moe` losses; None for a dense policy, which
    is refused when a `moe` loss coefficient is above 0 (`path`: the model, for the message)."""
    if not is_moe(model.config):
        if cfg.routing_replay != "off":
            raise ValueError(
                f"moe.routing_replay={cfg.routing_replay!r}: the policy {path} is a dense model (no routed "
                "experts); set it to 'off'"
            )
        if cfg.on:
            raise ValueError(
                f"moe.aux_loss_coef={cfg.aux_loss_coef}, moe.z_loss_coef={cfg.z_loss_coef}: the policy "
                f"{path} is a dense model (no routed experts); set both to 0"
            )
        return None
    used = select_experts(model, device)
    log.info(
        "MoE policy: %d experts, top-%d, experts run %s", num_experts(model.config),
        experts_per_token(model.config), used,
    )  # fmt: skip
    if cfg.routing_replay != "off" and model.config.model_type not in REPLAYABLE:
        raise ValueError(
            f"moe.routing_replay={cfg.routing_replay!r}: {model.config.model_type} routers are not "
            f"replayable (softmax top-k routers only: {sorted(REPLAYABLE)}); set it to 'off'"
        )
    return RouterLogits(model)


def check_lora_targets(model: nn.Module) -> None:
    """Refuse a LoRA adapter on an MoE policy outside its attention. peft (0.21) does wrap a transformers
    5 MoE's fused 3-D experts and its router (`all-linear` reaches them, as parameter wrappers), but
    whether vLLM's LoRA loader serves such an adapter (the names, the fused layout, the router and shared
    experts) is not established for these families, so only attention (`q_proj`, `k_proj`, `v_proj`,
    `o_proj`), which vLLM serves for all of them, is accepted. Raises ValueError naming
    `lora.target_modules` and the modules outside attention."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    outside = sorted(
        n
        for n, m in model.named_modules()
        if isinstance(m, BaseTunerLayer) and ".self_attn." not in n and not n.endswith(".base_layer")
    )
    if outside:
        raise ValueError(
            f"lora.target_modules: an MoE policy takes LoRA on its attention alone (q_proj, k_proj, v_proj, "
            f"o_proj), but the adapter would cover {outside[:4]}{' ...' if len(outside) > 4 else ''}: list "
            "the attention projections in lora.target_modules"
        )


def router_class(model: nn.Module) -> tuple[type[nn.Module], int]:
    """The router module class of `model` and the index of its logits in the router's output, as
    transformers records `router_logits` (`_can_record_outputs`)."""
    recorder = (getattr(model, "_can_record_outputs", None) or {}).get("router_logits")
    if recorder is None or getattr(recorder, "target_class", None) is None:
        raise ValueError(f"{type(model).__name__} records no router logits: not a supported MoE model")
    return recorder.target_class, recorder.index


class RouterLogits:
    """Forward hooks on every router of `model` (layer order): they keep each layer's router logits
    (T, E) for the forward passes run inside `collect()` (and no others: pi_old, the reference, and the
    recomputation of checkpointed layers in the backward pass are not collected), and apply `routes`.

    Routing replay (`moe.routing_replay`): while `routes` is set ((T, L, K) long over the forward's
    flattened tokens, -1 = route freely), each router's output `(logits, weights, indices)` becomes
    `(logits, w, given)` on the tokens with a row: `given` the row's experts, `w` = softmax(logits) at
    them (fp32), renormalized over the k where the router does (`norm_topk_prob`; Mixtral always), in the
    router's weight dtype: the gate weights stay functions of the router's logits, so it still learns. With
    `replay` False the routes are only compared. The routes stay set until the next `set_routes`, so the
    recomputation of checkpointed layers in the backward pass routes as the forward did. Inside
    `counting()` the hooks also count `agreement` ((2,) long: token-layers whose own top-k set equals the
    given one, token-layers with a row), `token_agreement` ((T,) long: each token's layers whose own top-k
    set equals the given one) and, with `record` set, append each layer's own indices (T, K)."""

    def __init__(self, model: nn.Module) -> None:
        cls, self.index = router_class(model)
        self.routers = [m for m in model.modules() if isinstance(m, cls)]
        if not self.routers:
            raise ValueError(f"{type(model).__name__} has no {cls.__name__} modules")
        self.layer = {id(m): i for i, m in enumerate(self.routers)}
        self._kept: list[torch.Tensor] | None = None
        self.routes: torch.Tensor | None = None  # (T, L, K) long, -1 = free
        self.replay = False
        self.record: list[torch.Tensor] | None = None  # own indices (T, K) per layer, inside counting()
        self.agreement: torch.Tensor | None = None  # (2,) long, inside counting()
        self.token_agreement: torch.Tensor | None = None  # (T,) long: agreeing layers per token, counting()
        self._counting = False
        self._handles = [m.register_forward_hook(self._hook) for m in self.routers]

    def _hook(self, module: nn.Module, args: Any, output: Any) -> Any:
        if self._kept is not None:
            self._kept.append(output[self.index] if isinstance(output, tuple) else output)
        if not self._counting and not self.replay:
            return None
        logits, weights, own = output  # (T, E), (T, K), (T, K)
        if self._counting and self.record is not None:
            self.record.append(own.detach())
        if self.routes is None:
            return None
        given = self.routes[:, self.layer[id(module)]]  # (T, K)
        if given.shape != own.shape:
            raise ValueError(f"routing replay: routes {tuple(given.shape)} for a router's {tuple(own.shape)}")
        has = given[:, 0] >= 0  # (T,): tokens with a row
        if self._counting:
            same = (own.detach().sort(-1).values == given.sort(-1).values).all(-1) & has  # (T,)
            count = torch.stack([same.sum(), has.sum()])  # (2,)
            self.agreement = count if self.agreement is None else self.agreement + count
            prior = self.token_agreement
            self.token_agreement = same.long() if prior is None else prior + same  # (T,)
        if not self.replay:
            return None
        chosen = torch.where(has[:, None], given, own)  # (T, K)
        w = torch.softmax(logits, dim=-1, dtype=torch.float32).gather(-1, chosen)  # (T, K)
        if getattr(module, "norm_topk_prob", True):
            w = w / w.sum(-1, keepdim=True)
        return logits, torch.where(has[:, None], w.to(weights.dtype), weights), chosen

    def set_routes(self, routes: torch.Tensor | None, replay: bool) -> None:
        """Route (`replay`) or compare by `routes` ((T, L, K), -1 = free) until the next call; None = free."""
        self.routes, self.replay = routes, replay and routes is not None

    @contextlib.contextmanager
    def counting(self, record: bool = False) -> Iterator[None]:
        """Count `agreement` (and with `record` keep the own indices in `record`) in the forwards inside."""
        self._counting, self.agreement, self.token_agreement = True, None, None
        self.record = [] if record else None
        try:
            yield
        finally:
            self._counting = False

    @contextlib.contextmanager
    def collect(self) -> Iterator[list[torch.Tensor]]:
        """The list that the forward passes inside fill with each router's logits (T, E)."""
        self._kept = kept = []
        try:
            yield kept
        finally:
            self._kept = None

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def forward_routes(batch: Any, routes: torch.Tensor, packed: bool) -> torch.Tensor:
    """`routes` ((b, R, L, K), response layout: column j = the position predicting response token j) in
    the forward's flattened token layout, (T, L, K) long, -1 on positions without a row (the prompt,
    padding): T = b x (P + R) padded, the real tokens packed (learner/model/policy.py `pack`)."""
    b, width = batch.input_ids.shape
    R, P = routes.shape[1], batch.prompt_width
    full = routes.new_full((b, width, *routes.shape[2:]), -1)  # (b, P+R, L, K)
    full[:, P - 1 : P - 1 + R] = routes
    full = full.long()
    return full[batch.attention_mask.bool()] if packed else full.flatten(0, 1)  # (T, L, K)


def response_layout(flat: torch.Tensor, batch: Any, packed: bool, fill: int = -1) -> torch.Tensor:
    """Per-token values of a forward (T, ...) in the response layout (b, R, ...): column j = the position
    predicting response token j; positions a packed forward did not compute hold `fill`."""
    b, width = batch.input_ids.shape
    if packed:
        full = flat.new_full((b, width, *flat.shape[1:]), fill)  # (b, P+R, ...)
        full[batch.attention_mask.bool()] = flat
    else:
        full = flat.view(b, width, *flat.shape[1:])
    P, R = batch.prompt_width, batch.response_ids.shape[1]
    return full[:, P - 1 : P - 1 + R]  # (b, R, ...)


def response_routes(record: list[torch.Tensor], batch: Any, packed: bool) -> torch.Tensor:
    """The recorded own indices (one (T, K) per layer) in the response layout (b, R, L, K) long."""
    return response_layout(torch.stack(record, 1), batch, packed)  # (b, R, L, K)


def replay_shape(policy: nn.Module) -> tuple[int, int]:
    """(sparse layers, top-k) of the policy (a `LogProbs` whose `router` is set): the (L, K) of the routed
    experts its forward replays."""
    router = getattr(policy, "router", None)
    if router is None:
        raise ValueError("moe.routing_replay: the policy has no routers (a dense model)")
    return len(router.routers), experts_per_token(policy.lm.config)


def router_losses(
    logits: list[torch.Tensor], top_k: int, mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(load-balancing loss, router z-loss), 0-d fp32, of the routers' `logits` (one (T, E) per layer,
    the same T tokens each); `mask` (T,) weights the tokens (1 real, 0 padding; None = all real).
    The load-balancing loss is transformers' `load_balancing_loss_func` (E sum_e f_e P_e, f_e the share
    of top-k assignments, P_e the mean probability, both over all layers' tokens; the counts carry no
    gradient, the probabilities do); the z-loss is mean over layers and tokens of logsumexp(logits)^2."""
    num_e = logits[0].shape[-1]
    device = logits[0].device
    w = torch.ones(logits[0].shape[0], device=device) if mask is None else mask.to(device, torch.float32)
    counts = torch.zeros(num_e, device=device)  # (E,): top-k assignments, mask-weighted
    probs = torch.zeros(num_e, device=device)  # (E,): summed router probabilities
    z = torch.zeros((), device=device)
    for layer in logits:
        x = layer.float()  # (T, E)
        p = torch.softmax(x, dim=-1)  # (T, E)
        chosen = torch.topk(p.detach(), top_k, dim=-1).indices  # (T, k)
        counts = counts.scatter_add(0, chosen.reshape(-1), w.repeat_interleave(top_k))
        probs = probs + (p * w[:, None]).sum(0)
        z = z + (torch.logsumexp(x, dim=-1).square() * w).sum()
    rows = w.sum().clamp(min=1.0) * len(logits)
    aux = num_e * torch.sum((counts / rows) * (probs / rows))
    return aux, z / rows
