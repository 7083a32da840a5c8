"""Two reward functions of your own, loaded by dotted path (docs/extend.md "A reward").

Put this folder on the actor's PYTHONPATH (compose: `OFFPOLICY_CODE_DIR`; Kubernetes: the `code` claim;
locally: `PYTHONPATH=examples/extend`) and name a function in the actor's config:

    reward: {name: my_reward.last_line_number}                               # per completion, sync
    reward: {name: my_reward.closest_first, signature: sample, batched: true}  # per group, async

The actor resolves the name once at start (`offpolicy.actors.rollout.rewards.resolve_reward`: a typo fails
there, not in the loop) and runs it through `offpolicy.actors.rollout.scoring.Scorer`, off the engine's
event loop: sync functions on worker threads, async ones awaited, under `reward.timeout_s`. Anything a
function raises, or a value that is not a finite number, sets the group aside as a reward failure (counted
by reason); it never stops the actor.

    python examples/extend/my_reward.py     # scores two completions with each, through the actor's Scorer
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Mapping, Sequence

from offpolicy.actors.errors import RewardError
from offpolicy.actors.rollout.scoring import RewardSample

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def last_line_number(completion: str, answer: str | None, metadata: Mapping[str, str]) -> float:
    """`signature: text` (the default): 1.0 when the completion's last non-empty line holds the answer's
    number, else 0.0. A record without an answer is the data's fault: `RewardError` with reason
    `no_answer` says so in the actor's status and metrics."""
    if answer is None:
        raise RewardError("last_line_number: the record has no `answer`", reason="no_answer")
    lines = [line for line in completion.splitlines() if line.strip()]
    found = _NUMBER.findall(lines[-1]) if lines else []
    return 1.0 if found and float(found[-1]) == float(answer) else 0.0


async def closest_first(samples: Sequence[RewardSample]) -> list[float]:
    """`signature: sample, batched: true`: one call per group, every completion of one prompt at once (a
    group-relative reward, or one request to a judge for the whole group). Here: completions ranked by how
    close their last number is to the answer, 1.0 for the closest down to 0.0 for the farthest (an async
    function is awaited on the actor's loop: do I/O here, never block)."""
    await asyncio.sleep(0)  # stands in for an awaited call (a judge model, a sandbox)
    answer = float(samples[0].answer) if samples and samples[0].answer is not None else 0.0

    def distance(sample: RewardSample) -> float:
        found = _NUMBER.findall(sample.completion)
        return abs(float(found[-1]) - answer) if found else float("inf")

    order = sorted(range(len(samples)), key=lambda i: distance(samples[i]))
    step = 1.0 / max(len(samples) - 1, 1)
    rewards = [0.0] * len(samples)
    for rank, i in enumerate(order):
        rewards[i] = 1.0 - rank * step
    return rewards


# --- run it the way the actor does


def demo() -> dict[str, list[float]]:
    """Each function above scored through the actor's `Scorer` on one prompt and three completions."""
    from offpolicy.actors.config import RewardConfig
    from offpolicy.actors.data.prompts import Prompt
    from offpolicy.actors.rollout.scoring import Scorer

    prompt = Prompt(index=0, prompt_id="sum-1", text="What is 3+8?", answer="11")
    completions = ["3+8 is\n11", "It is 12", "no idea"]
    configs = {
        "my_reward.last_line_number": RewardConfig(name="my_reward.last_line_number"),
        "my_reward.closest_first": RewardConfig(
            name="my_reward.closest_first", signature="sample", batched=True
        ),
    }
    scores = {}
    for name, config in configs.items():
        scorer = Scorer(config)
        try:
            scores[name] = asyncio.run(scorer.score(prompt, completions))
        finally:
            scorer.close()
    return scores


if __name__ == "__main__":
    for name, values in demo().items():
        print(name, values)
