"""What the learner trains on: loading a Hugging Face causal LM, its attention kernels on packed rows, the
policy's forward (log-probs of the sampled tokens through the fused LM head), the GAE critic, numerical
precision, mixture-of-experts models (model/moe.py), and the tiny local models of the quickstart and tests."""

from offpolicy.learner.model.critic import ValueModel
from offpolicy.learner.model.load import checkpoint_dtype, load_model, load_tokenizer, unique_state
from offpolicy.learner.model.policy import LogProbs, response_hidden_states, token_logprobs
from offpolicy.learner.model.precision import Precision, PrecisionName, pick_device
from offpolicy.learner.model.tiny import (
    build_char_tokenizer,
    make_tiny_model,
    make_tiny_moe_model,
    make_tiny_vl_model,
    sample_completions,
)

__all__ = [
    "LogProbs",
    "Precision",
    "PrecisionName",
    "ValueModel",
    "build_char_tokenizer",
    "checkpoint_dtype",
    "load_model",
    "load_tokenizer",
    "make_tiny_model",
    "make_tiny_moe_model",
    "make_tiny_vl_model",
    "pick_device",
    "response_hidden_states",
    "sample_completions",
    "token_logprobs",
    "unique_state",
]
