"""Encode/decode whole batches of groups (insert_many, sample): per group its frame or its rejection.

What a batch shares is checked once: the types and lengths of all its groups (`codec.plain`, a few
set/map passes over every trajectory), and, for a batch under `_CONCAT_BYTES` of arrays, the array
values (copied together and checked with three reductions, where per-group checks would cost three
numpy calls per group). Bigger batches check each frame's own views (copying megabytes costs more than
the calls). A batch with anything unusual goes group by group through `encode_group`'s exact path.
Decoded arrays are read-only views into each group's own payload.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from operator import attrgetter

import numpy as np

from offpolicy.buffer.codec import build, decode_group, encode_group, frame, parse, plain, raise_frame_values
from offpolicy.buffer.config import CodecLimits
from offpolicy.buffer.errors import InvalidTrajectory
from offpolicy.buffer.types import TrajectoryGroup
from offpolicy.buffer.validation import check_values

__all__ = ["decode_groups", "encode_groups"]

_CONCAT_BYTES = 256 * 1024  # below this many bytes of arrays a batch's values are checked together
_I32, _F32 = np.dtype("<i4"), np.dtype("<f4")
_ids, _behavior_logprobs = attrgetter("response_ids"), attrgetter("behavior_logprobs")


def _batch_values_ok(groups: Sequence[TrajectoryGroup]) -> bool | None:
    """The values of a plain batch checked together, or None when it is too big to copy cheaply."""
    trs = [t for g in groups for t in g.trajectories]
    behavior_logprobs_list = list(map(_behavior_logprobs, trs))
    ints = [
        *(g.prompt_ids for g in groups),
        *map(_ids, trs),
        *(t.versions for t in trs if t.versions is not None),
    ]
    if 4 * (sum(map(len, ints)) + sum(map(len, behavior_logprobs_list))) > _CONCAT_BYTES:
        return None
    return check_values(np.concatenate(ints), np.concatenate(behavior_logprobs_list))


def encode_groups(groups: Sequence[TrajectoryGroup], limits: CodecLimits) -> list[bytes | InvalidTrajectory]:
    """Validate and encode a batch: per group its bytes, or the `InvalidTrajectory` naming its field."""
    if not plain(groups, limits):
        encode = partial(encode_group, limits=limits)  # the exact path, group by group
    else:
        values_ok = _batch_values_ok(groups)  # None: too big to check together, each frame checks its own
        encode = (
            partial(encode_group, limits=limits)
            if values_ok is False
            else partial(frame, limits=limits, values_checked=bool(values_ok))
        )
    out: list[bytes | InvalidTrajectory] = []
    for g in groups:
        try:
            out.append(encode(g))
        except InvalidTrajectory as e:  # this group only
            out.append(e)
    return out


def decode_groups(payloads: Sequence[bytes], limits: CodecLimits) -> list[TrajectoryGroup]:
    """Decode and validate a batch; the first invalid payload raises `InvalidTrajectory` naming the field."""
    if len(payloads) < 2:
        return [decode_group(p, limits) for p in payloads]
    frames = [parse(p, limits) for p in payloads]
    ints, behavior_logprobs_list = [f[2] for f in frames], [f[3] for f in frames]
    small = 4 * (sum(map(len, ints)) + sum(map(len, behavior_logprobs_list))) <= _CONCAT_BYTES
    if not (small and check_values(np.concatenate(ints), np.concatenate(behavior_logprobs_list))):
        for f in frames:
            if not check_values(f[2], f[3]):
                raise_frame_values(*f[:4], limits)
    return [build(*f) for f in frames]
