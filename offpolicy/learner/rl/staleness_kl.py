"""The k1 off-policy KL per staleness bucket: mean over tokens of (log pi_rollout - log pi_train).

A learner step fills one `StalenessKL` over its passes (rl/step.py, rl/update.py) and reports it as
`offpolicy_kl/<bucket>`, one value per bucket of `STALENESS_BUCKETS` (learner/metrics.py, whose gauge
`offpolicy_learner_offpolicy_kl{staleness}` exports it). Everything stays on the tensors' device until
`result`.
"""

from __future__ import annotations

import torch

from offpolicy.learner.metrics import STALENESS_BUCKETS

STALENESS_EDGES = (0, 1, 3, 7)  # of STALENESS_BUCKETS, bucketize(right=False): 0 | 1 | 2-3 | 4-7 | 8+


def staleness_bucket_index(staleness: torch.Tensor) -> torch.Tensor:
    """Staleness in steps, any shape → index into STALENESS_BUCKETS, same shape."""
    edges = torch.tensor(STALENESS_EDGES, device=staleness.device, dtype=staleness.dtype)
    return torch.bucketize(staleness, edges, right=False)


class StalenessKL:
    """Accumulates the k1 off-policy KL, mean over tokens of (log pi_rollout - log pi_train), per bucket."""

    def __init__(self) -> None:
        self.sums = torch.zeros(len(STALENESS_BUCKETS), dtype=torch.float64)
        self.counts = torch.zeros(len(STALENESS_BUCKETS), dtype=torch.float64)

    def add(
        self, train_lp: torch.Tensor, rollout_lp: torch.Tensor, mask: torch.Tensor, staleness: torch.Tensor
    ):
        """Rows (B, R) with their staleness: per token (B, R) (`batching.token_staleness`: tokens of a
        completion that spans a weight update land in their own buckets) or per row (B,). Everything
        stays on the tensors' device until `result`."""
        if staleness.dim() == 1:
            staleness = staleness[:, None].expand_as(mask)  # (B, R)
        bucket = staleness_bucket_index(staleness).flatten()  # (B*R,)
        tok_kl = ((rollout_lp - train_lp.detach()) * mask).flatten().double()  # (B*R,)
        dev = tok_kl.device
        self.sums = self.sums.to(dev).index_add(0, bucket, tok_kl)
        self.counts = self.counts.to(dev).index_add(0, bucket, mask.flatten().double())

    def result(self) -> dict[str, float]:
        """{bucket: KL} for the buckets that saw tokens (one host transfer)."""
        sums, counts = torch.stack([self.sums, self.counts]).cpu().tolist()
        return {b: s / c for b, s, c in zip(STALENESS_BUCKETS, sums, counts, strict=True) if c > 0}
