"""Per-token means by staleness bucket: the k1 off-policy KL, mean over tokens of (log pi_rollout - log
pi_train), and an MoE policy's router agreement and log-prob gap.

A learner step fills one `StalenessKL` over its passes (rl/step.py, rl/update.py) and reports it as
`offpolicy_kl/<bucket>`, one value per bucket of `STALENESS_BUCKETS` (learner/metrics.py, whose gauge
`offpolicy_learner_offpolicy_kl{staleness}` exports it); an MoE step with routed rows fills a
`RoutingByStaleness` in its update forwards (`moe/router_agreement/<bucket>`, `moe/logprob_gap/<bucket>`).
Everything stays on the tensors' device until `result`.
"""

from __future__ import annotations

import torch

from offpolicy.learner.metrics import STALENESS_BUCKETS

STALENESS_EDGES = (0, 1, 3, 7)  # of STALENESS_BUCKETS, bucketize(right=False): 0 | 1 | 2-3 | 4-7 | 8+


def staleness_bucket_index(staleness: torch.Tensor) -> torch.Tensor:
    """Staleness in steps, any shape → index into STALENESS_BUCKETS, same shape."""
    edges = torch.tensor(STALENESS_EDGES, device=staleness.device, dtype=staleness.dtype)
    return torch.bucketize(staleness, edges, right=False)


class StalenessMean:
    """Accumulates a per-token value's mean per staleness bucket (sums and counts on the values' device)."""

    def __init__(self) -> None:
        self.sums = torch.zeros(len(STALENESS_BUCKETS), dtype=torch.float64)
        self.counts = torch.zeros(len(STALENESS_BUCKETS), dtype=torch.float64)

    def add_values(self, values: torch.Tensor, mask: torch.Tensor, staleness: torch.Tensor) -> None:
        """`values` (B, R) weighted by `mask` (B, R) into the buckets of `staleness`, per token (B, R)
        (`batching.token_staleness`: tokens of a completion that spans a weight update land in their own
        buckets) or per row (B,)."""
        if staleness.dim() == 1:
            staleness = staleness[:, None].expand_as(mask)  # (B, R)
        bucket = staleness_bucket_index(staleness).flatten()  # (B*R,)
        weighted = (values.detach() * mask).flatten().double()  # (B*R,)
        dev = weighted.device
        self.sums = self.sums.to(dev).index_add(0, bucket, weighted)
        self.counts = self.counts.to(dev).index_add(0, bucket, mask.flatten().double())

    def result(self) -> dict[str, float]:
        """{bucket: mean} for the buckets that saw tokens (one host transfer)."""
        sums, counts = torch.stack([self.sums, self.counts]).cpu().tolist()
        return {b: s / c for b, s, c in zip(STALENESS_BUCKETS, sums, counts, strict=True) if c > 0}


class StalenessKL(StalenessMean):
    """Accumulates the k1 off-policy KL, mean over tokens of (log pi_rollout - log pi_train), per bucket."""

    def add(
        self, train_lp: torch.Tensor, rollout_lp: torch.Tensor, mask: torch.Tensor, staleness: torch.Tensor
    ) -> None:
        """Rows (B, R) with their staleness, per token (B, R) or per row (B,)."""
        self.add_values(rollout_lp - train_lp.detach(), mask, staleness)


class RoutingByStaleness:
    """An MoE step's router agreement (share of layers whose own top-k equals the rollout's, or the replayed,
    choices) and log-prob gap (|log pi_theta - log mu|) per staleness bucket, over the update's forwards:
    `moe/router_agreement/<bucket>`, `moe/logprob_gap/<bucket>` (learner/metrics.py exports them by
    bucket). Agreement counts the tokens with routed rows; the gap every response token."""

    def __init__(self) -> None:
        self.agreement, self.gap = StalenessMean(), StalenessMean()

    def add(
        self,
        agreement: torch.Tensor,
        rows: torch.Tensor,
        gap: torch.Tensor,
        mask: torch.Tensor,
        ages: torch.Tensor,
    ) -> None:
        """(b, R) each: agreement share, rows with routes (0/1), |log-prob gap|, response mask, token ages."""
        self.agreement.add_values(agreement, rows * mask, ages)
        self.gap.add_values(gap, mask, ages)

    def tensors(self) -> list[torch.Tensor]:
        return [self.agreement.sums, self.agreement.counts, self.gap.sums, self.gap.counts]

    def set_tensors(self, tensors: list[torch.Tensor]) -> None:
        self.agreement.sums, self.agreement.counts, self.gap.sums, self.gap.counts = tensors

    def result(self) -> dict[str, float]:
        out = {f"moe/router_agreement/{b}": v for b, v in self.agreement.result().items()}
        return out | {f"moe/logprob_gap/{b}": v for b, v in self.gap.result().items()}
