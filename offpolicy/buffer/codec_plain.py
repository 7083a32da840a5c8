"""The codec's fast path: whether a batch of groups can be framed as it is (`plain`), checked over the whole
batch at once with a few set/map passes; anything else goes through `validate_group` (buffer/codec.py)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from operator import attrgetter

import numpy as np

from offpolicy.buffer.config import CodecLimits
from offpolicy.buffer.types import READABLE_SCHEMA_VERSIONS, SamplingParams, TrajectoryGroup
from offpolicy.buffer.validation import mask_ok

__all__ = ["plain"]

_I32 = np.dtype("<i4")
_F32 = np.dtype("<f4")
_NUM = frozenset((float, int))
_STR = frozenset((str,))
_ARRAY = frozenset((np.ndarray,))
_PACKED = frozenset(((4,),))  # the strides of a 1-D C-contiguous array of 4-byte items
_dtype, _strides = attrgetter("dtype"), attrgetter("strides")
_ids, _behavior_logprobs = attrgetter("response_ids"), attrgetter("behavior_logprobs")
_versions = attrgetter("versions")
_reward, _reason, _prompt = attrgetter("reward"), attrgetter("finish_reason"), attrgetter("prompt_ids")


def _plain_header(g: TrajectoryGroup, limits: CodecLimits) -> bool:
    s, trs = g.sampling, g.trajectories
    return (
        g.schema_version in READABLE_SCHEMA_VERSIONS
        and type(g.group_id) is str
        and type(g.prompt_id) is str
        and type(g.actor_id) is str
        and g.group_id != ""
        and g.prompt_id != ""
        and g.actor_id != ""
        and type(g.policy_version) is int
        and g.policy_version >= 0
        and type(g.created_at) in _NUM
        and math.isfinite(g.created_at)
        and type(trs) is list
        and 0 < len(trs) <= limits.max_completions_per_group
        and (
            g.priority is None or (type(g.priority) in _NUM and math.isfinite(g.priority) and g.priority >= 0)
        )
        and type(s) is SamplingParams
        and set(map(type, (s.temperature, s.top_p, s.top_k, s.max_tokens))) <= _NUM
        and math.isfinite(s.temperature)
        and s.temperature > 0
        and 0 < s.top_p <= 1
        and s.max_tokens >= 1
        and type(g.metadata) is dict
        and set(map(type, g.metadata)) <= _STR
        and set(map(type, g.metadata.values())) <= _STR
        and len(g.prompt_ids) <= limits.max_prompt_tokens
    )


def plain(groups: Sequence[TrajectoryGroup], limits: CodecLimits) -> bool:
    """True when every group can be framed as it is: every type exact (int32 / float32 C-contiguous 1-D
    arrays, plain str / int / float fields) and every check but the array values passed. Checked over a
    whole batch at once; anything else goes through `validate_group`, which names the field or accepts
    what only looked unusual (and converts it)."""
    if not all(_plain_header(g, limits) for g in groups):
        return False
    trs = [t for g in groups for t in g.trajectories]
    ids, rewards = list(map(_ids, trs)), list(map(_reward, trs))
    behavior_logprobs_list = list(map(_behavior_logprobs, trs))
    versioned = [t for t in trs if t.versions is not None]
    ints = [*map(_prompt, groups), *ids, *map(_versions, versioned)]
    lens = list(map(len, ids))
    return (
        set(map(type, ints)) | set(map(type, behavior_logprobs_list)) <= _ARRAY
        and set(map(_dtype, ints)) <= {_I32}
        and set(map(_dtype, behavior_logprobs_list)) <= {_F32}
        and set(map(_strides, ints)) | set(map(_strides, behavior_logprobs_list)) <= _PACKED  # 1-D, packed
        and lens == list(map(len, behavior_logprobs_list))
        and min(lens) >= 1
        and max(lens) <= limits.max_tokens_per_completion
        and all(len(t.versions) == len(t.response_ids) for t in versioned)
        and all(mask_ok(t.policy_mask, len(t.response_ids)) for t in trs)
        and set(map(type, rewards)) <= _NUM
        and all(map(math.isfinite, rewards))
        and set(map(type, map(_reason, trs))) <= _STR
        and all(t.routed_experts is None for t in trs)  # routing: the exact path (`validate_group`)
    )
