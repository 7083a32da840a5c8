"""An example user reward module, the one docs/deploy.md's walk-through mounts: copy this folder as your
`OFFPOLICY_CODE_DIR` (compose) or into the `code` claim (Kubernetes), then set `reward.name:
my_rewards.score` in the actor's config. The folder is on every service's PYTHONPATH.

A reward is `fn(completion: str, answer: str | None, metadata: dict[str, str]) -> float` (docs/actor.md
"Rewards"); it runs in the actor's reward threads, never on the engine's loop.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def score(completion: str, answer: str | None, metadata: Mapping[str, str]) -> float:
    """1.0 when the last number in the completion equals the answer's, 0.1 for a well-formed answer with the
    wrong number, 0.0 when the completion has no number at all (or the record no answer)."""
    found = _NUMBER.findall(completion)
    if answer is None or not found:
        return 0.0
    return 1.0 if float(found[-1]) == float(answer) else 0.1
