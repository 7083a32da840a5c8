"""Evaluation results of a run, in a Redis stream beside its buffer: the evaluating actor appends one
record per evaluated policy version, the learner reads the new ones at each step (its JSONL line and
trackers) and anyone can list them. Records are JSON (no pickle); the stream keeps the newest 10,000."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from offpolicy.buffer.keys import _prefix
from offpolicy.buffer.storage import async_client, call_async, call_sync, sync_client

_MAXLEN = 10_000


def _noop() -> None:
    return None


@dataclass(frozen=True, slots=True)
class EvalRecord:
    """One evaluation of one policy version on the held-out set."""

    policy_version: int
    reward_mean: float  # over every sample of every prompt
    pass_at: dict[str, float]  # "1", "k": unbiased pass@k estimates (a sample passes at reward >= threshold)
    prompts: int
    samples_per_prompt: int
    seconds: float  # wall time of the evaluation
    actor_id: str
    created_at: float
    failed: int = 0  # prompts whose generation or reward failed (left out of the means)
    extra: dict[str, float] = field(default_factory=dict)

    def metrics(self) -> dict[str, float]:
        """The record as flat `eval/...` metrics (the learner's JSONL line, trackers)."""
        out = {
            "eval/policy_version": float(self.policy_version),
            "eval/reward_mean": self.reward_mean,
            "eval/prompts": float(self.prompts),
            "eval/failed": float(self.failed),
            "eval/seconds": self.seconds,
        }
        out |= {f"eval/pass@{k}": v for k, v in self.pass_at.items()}
        return out | {f"eval/{k}": v for k, v in self.extra.items()}

    def encode(self) -> str:
        return json.dumps(asdict(self), allow_nan=False)

    @classmethod
    def decode(cls, raw: str | bytes) -> EvalRecord:
        return cls(**json.loads(raw))


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k estimate of a prompt with `c` passing samples of `n` (Chen et al. 2021)."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def eval_key(run_id: str) -> str:
    return f"{_prefix(run_id)}:eval"


class EvalStore:
    """Synchronous access to a run's evaluation stream (the learner reads it)."""

    def __init__(self, redis_url: str, run_id: str, storage_timeout_s: float = 5.0) -> None:
        self.key = eval_key(run_id)
        self._timeout_s = storage_timeout_s
        self._client = sync_client(redis_url, 10.0)

    def add(self, record: EvalRecord) -> str:
        raw = call_sync(
            lambda: self._client.xadd(self.key, {"json": record.encode()}, maxlen=_MAXLEN, approximate=True),
            self._timeout_s, "add evaluation", _noop,
        )  # fmt: skip
        return raw.decode() if isinstance(raw, bytes) else str(raw)

    def after(self, last_id: str = "0", count: int = 100) -> list[tuple[str, EvalRecord]]:
        """Records added after stream id `last_id` ("0": from the start), oldest first."""
        rows = call_sync(
            lambda: self._client.xrange(self.key, min=f"({last_id}" if last_id != "0" else "-", count=count),
            self._timeout_s, "read evaluations", _noop,
        )  # fmt: skip
        return [(_id(i), EvalRecord.decode(fields[b"json"])) for i, fields in rows]

    def latest_id(self) -> str:
        """The stream id of the newest record ("0" when there is none): read `after` it for new ones."""
        rows = call_sync(
            lambda: self._client.xrevrange(self.key, count=1), self._timeout_s, "read evaluations", _noop
        )
        return _id(rows[0][0]) if rows else "0"

    def close(self) -> None:
        self._client.close()


class AsyncEvalStore:
    """Asyncio access to a run's evaluation stream (the evaluating actor appends to it)."""

    def __init__(self, redis_url: str, run_id: str, storage_timeout_s: float = 5.0) -> None:
        self.key = eval_key(run_id)
        self._timeout_s = storage_timeout_s
        self._client = async_client(redis_url, 10.0)

    async def add(self, record: EvalRecord) -> str:
        raw = await call_async(
            lambda: self._client.xadd(self.key, {"json": record.encode()}, maxlen=_MAXLEN, approximate=True),
            self._timeout_s, "add evaluation", _noop,
        )  # fmt: skip
        return _id(raw)

    async def close(self) -> None:
        await self._client.aclose()


def _id(raw: Any) -> str:
    return raw.decode() if isinstance(raw, bytes) else str(raw)
