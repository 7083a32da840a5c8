"""An environment of your own: a multi-turn episode in Python, loaded by dotted path (docs/extend.md
"An environment"; docs/agents.md has the whole episode API).

Put this folder on the actor's PYTHONPATH and name the function in the actor's config:

    environment: {name: my_environment.two_tries}

or try it on the quickstart's stack (its target-token toy prompts carry `answer: "a"`):

    PYTHONPATH=examples/extend offpolicy quickstart --environment my_environment.two_tries

The actor resolves the name once at start (`offpolicy.actors.rollout.episodes.resolve_environment`) and
runs `sampling.n` episodes of each prompt concurrently against its own vLLM engine; their completions form
one group. What the policy generates is recorded token for token with its behaviour log-probs (trained);
what the environment adds goes through the chat template and is masked (`policy_mask` False: attended,
never trained).

    python examples/extend/my_environment.py    # one episode against a scripted engine (no vLLM needed)
"""

from __future__ import annotations

from typing import Any

from offpolicy.actors.errors import RewardError
from offpolicy.actors.rollout.episodes import Episode, EpisodeResult

TURN_TOKENS = 8


async def two_tries(ep: Episode) -> EpisodeResult:
    """The policy answers; when its answer misses the prompt's `answer`, the user says so and the policy
    gets one more turn. Reward 1.0 for a first-turn hit, 0.5 for a second-turn hit, else 0.0."""
    target = ep.prompt.answer
    if not target:
        raise RewardError("two_tries: the prompt has no answer", reason="no_answer")
    first = await ep.generate(max_tokens=TURN_TOKENS)  # a policy turn: tokens, log-probs, versions recorded
    if target in first:
        return EpisodeResult(1.0, {"tries": "1"})
    ep.add_message("user", "no, try again")  # an environment turn: the chat template's tokens, masked
    second = await ep.generate(max_tokens=TURN_TOKENS)
    return EpisodeResult(0.5 if target in second else 0.0, {"tries": "2"})


# --- run one episode without vLLM: a scripted engine in place of the actor's


class ScriptedEngine:
    """Answers each turn with the next scripted text, one token per character (the char tokenizer), with
    behaviour log-prob -0.5 per token: the shape of `VLLMEngine.generate_group`'s answer."""

    def __init__(self, tokenizer: Any, script: list[str], version: int = 0) -> None:
        self.tokenizer, self.script, self.version = tokenizer, list(script), version

    async def generate_group(self, request_id: str, prompt_ids: Any, params: dict[str, Any]) -> list[Any]:
        import numpy as np

        from offpolicy.actors.engine.vllm import Completion

        text = self.script.pop(0)[: params["max_tokens"]]
        ids = np.asarray(self.tokenizer(text, add_special_tokens=False)["input_ids"], np.int32)
        lps = np.full(len(ids), -0.5, np.float32)
        return [Completion(ids, lps, "stop", text, np.full(len(ids), self.version, np.int32))]


def demo(script: list[str]) -> tuple[EpisodeResult, Any]:
    """One episode of `two_tries` whose policy turns say `script`, as the actor builds it (the tiny
    model's character tokenizer, `sampling.max_tokens` 64); its result and its completion."""
    import asyncio

    from offpolicy.actors.data.prompts import Prompt
    from offpolicy.actors.rollout.episodes import as_result, resolve_environment
    from offpolicy.learner.model import build_char_tokenizer

    environment = resolve_environment("my_environment.two_tries")  # what the actor does at start
    tokenizer = build_char_tokenizer()
    prompt = Prompt(index=0, prompt_id="toy-0", text="Say a.", answer="a")
    prompt_ids = tokenizer("Say a.", add_special_tokens=False)["input_ids"]
    engine = ScriptedEngine(tokenizer, script, version=3)

    def params_for(max_tokens: int, **overrides: Any) -> dict[str, Any]:
        return {"max_tokens": max_tokens, **overrides}

    ep = Episode(prompt, prompt_ids, engine, tokenizer, params_for, budget=64, version=3)
    result = as_result(asyncio.run(environment(ep)))
    return result, ep.completion()


if __name__ == "__main__":
    result, completion = demo(["bbb", "aaa"])
    print("reward", result.reward, dict(result.metadata))
    print("policy_mask", "".join("P" if m else "e" for m in completion.policy_mask))
