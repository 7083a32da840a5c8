"""Two built-in environments (actors/rollout/episodes.py), small enough for the tiny character model.

- `guessing_game`: the policy has three turns to say the secret character (`metadata["target"]`, or the
  prompt's `answer`); after each turn the user answers `warmer` when that turn held the character more
  often than the one before, else `colder`. Reward: the share of the policy's characters that are the
  secret one, over all its turns (what `target_token_share` rewards, spread over a conversation).
- `calculator`: the prompt holds a sum `a+b`; after the policy's first turn (its "call") a tool message
  gives the result, and the policy answers in a second turn. Reward: the share of the answer's characters
  that are digits of the result.

Both reward per policy token, so the tiny model can climb them in a few steps; they show the shape of a
multi-turn episode (policy turns sampled by the engine, environment turns through the chat template).
"""

from __future__ import annotations

import re

from offpolicy.actors.errors import RewardError
from offpolicy.actors.rollout.episodes import Episode, EpisodeResult

TURNS = 3
TURN_TOKENS = 6
_SUM = re.compile(r"(\d+)\s*\+\s*(\d+)")


async def guessing_game(ep: Episode) -> EpisodeResult:
    target = ep.prompt.metadata.get("target") or ep.prompt.answer
    if not target:
        raise RewardError(
            "guessing_game: the prompt has no target (metadata['target'] or answer)", "no_answer"
        )
    said, hits, last = 0, 0, -1
    for turn in range(TURNS):
        text = await ep.generate(max_tokens=TURN_TOKENS)
        count = text.count(target)
        said, hits = said + len(text), hits + count
        if turn < TURNS - 1:
            ep.add_message("user", "warmer" if count > last else "colder")
        last = count
    return EpisodeResult(hits / said if said else 0.0, {"turns": str(ep.turns)})


async def calculator(ep: Episode) -> EpisodeResult:
    found = _SUM.search(ep.prompt.text)
    if found is None:
        raise RewardError("calculator: the prompt holds no sum a+b")
    result = str(int(found.group(1)) + int(found.group(2)))
    await ep.generate(max_tokens=TURN_TOKENS)  # the policy's call
    ep.add_message("tool", result)
    answer = await ep.generate(max_tokens=TURN_TOKENS)
    share = sum(ch in result for ch in answer) / len(answer) if answer else 0.0
    return EpisodeResult(share, {"result": result})
