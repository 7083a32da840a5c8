"""configs/recipes/verl-gsm8k-grpo: verl's own GSM8K GRPO example, value for value. Each key of the example
(examples/grpo_trainer/run_qwen2-7b.sh) and each verl 0.9.1 default it leaves alone (read from the installed
verl's `_generated_ppo_trainer.yaml`) is read beside the recipe's value, or is one of the few that cannot
match, each named with its reason in the recipe's header. The recipe passes `offpolicy config check` with
this machine's paths (`--model-dir`, `--data`) for its documented 4 learner GPUs of 80 GiB."""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from deploy.checks import ROOT, read_env_file
from offpolicy.actors.config import load_config as load_actor_config
from offpolicy.learner.config import load_config as load_learner_config
from offpolicy.services.cli import main
from tests.data.gsm8k import verl_rows
from tests.data.models import QWEN_7B_CONFIG, write_config

RECIPE = ROOT / "configs" / "recipes" / "verl-gsm8k-grpo"
GSM8K_TRAIN = 7473
"""GSM8K's training split: verl's dataloader drops the last partial batch, so an epoch is 7 steps of 1024."""

EXAMPLE = {  # examples/grpo_trainer/run_qwen2-7b.sh, volcengine/verl a31a8f2 (2025-07-14), as it sets them
    "algorithm.adv_estimator": "grpo",
    "data.train_batch_size": 1024,
    "data.max_prompt_length": 512,
    "data.max_response_length": 1024,
    "data.filter_overlong_prompts": True,
    "actor_rollout_ref.model.path": "Qwen/Qwen2-7B-Instruct",
    "actor_rollout_ref.actor.optim.lr": 1e-6,
    "actor_rollout_ref.model.use_remove_padding": True,
    "actor_rollout_ref.actor.ppo_mini_batch_size": 256,
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 40,
    "actor_rollout_ref.actor.use_kl_loss": True,
    "actor_rollout_ref.actor.kl_loss_coef": 0.001,
    "actor_rollout_ref.actor.kl_loss_type": "low_var_kl",
    "actor_rollout_ref.actor.entropy_coeff": 0,
    "actor_rollout_ref.model.enable_gradient_checkpointing": True,
    "actor_rollout_ref.actor.fsdp_config.param_offload": False,
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload": False,
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": 40,
    "actor_rollout_ref.rollout.tensor_model_parallel_size": 2,
    "actor_rollout_ref.rollout.gpu_memory_utilization": 0.6,
    "actor_rollout_ref.rollout.n": 5,
    "actor_rollout_ref.ref.fsdp_config.param_offload": True,
    "algorithm.use_kl_in_reward": False,
    "trainer.logger": ["console", "wandb"],
    "trainer.project_name": "verl_grpo_example_gsm8k",
    "trainer.experiment_name": "qwen2_7b_function_rm",
    "trainer.n_gpus_per_node": 8,
    "trainer.nnodes": 1,
    "trainer.save_freq": 20,
    "trainer.test_freq": 5,
    "trainer.total_epochs": 15,
}
DEFAULTS = [  # what the example leaves to verl 0.9.1's defaults (read from the installed verl below)
    "actor_rollout_ref.actor.clip_ratio_low",
    "actor_rollout_ref.actor.clip_ratio_high",
    "actor_rollout_ref.actor.clip_ratio_c",
    "actor_rollout_ref.actor.loss_agg_mode",
    "actor_rollout_ref.actor.ppo_epochs",
    "actor_rollout_ref.actor.grad_clip",
    "actor_rollout_ref.actor.optim.weight_decay",
    "actor_rollout_ref.actor.optim.betas",
    "actor_rollout_ref.actor.optim.lr_warmup_steps",
    "actor_rollout_ref.actor.optim.lr_scheduler_type",
    "actor_rollout_ref.rollout.temperature",
    "actor_rollout_ref.rollout.top_p",
    "actor_rollout_ref.rollout.top_k",
    "actor_rollout_ref.rollout.val_kwargs.n",
    "actor_rollout_ref.rollout.val_kwargs.do_sample",
    "actor_rollout_ref.rollout.val_kwargs.temperature",
    "algorithm.norm_adv_by_std_in_grpo",
    "algorithm.rollout_correction.rollout_is",
    "algorithm.rollout_correction.rollout_rs",
    "algorithm.rollout_correction.bypass_mode",
    "data.shuffle",
    "trainer.val_before_train",
    "trainer.max_actor_ckpt_to_keep",
]

Ours = Callable[[Any, Any], Any]
VERSIONS_PER_STEP: Ours = lambda lr, ac: lr.groups_per_step // lr.mini_batch_groups  # noqa: E731
MAP: dict[str, tuple[Ours, Callable[[Any], Any]]] = {
    # verl key: (the recipe's value from (learner, actor), verl's value in the recipe's terms)
    "algorithm.adv_estimator": (lambda lr, ac: lr.adv_estimator, lambda v: v),
    "data.train_batch_size": (lambda lr, ac: lr.groups_per_step, lambda v: v),
    "data.max_prompt_length": (lambda lr, ac: ac.engine.max_model_len - ac.sampling.max_tokens, lambda v: v),
    "data.max_response_length": (lambda lr, ac: ac.sampling.max_tokens, lambda v: v),
    # always on here: a prompt over max_model_len - max_tokens (512) is skipped, counted as prompt_too_long
    "data.filter_overlong_prompts": (lambda lr, ac: True, lambda v: v),
    "algorithm.use_kl_in_reward": (lambda lr, ac: False, lambda v: v),  # no KL in the reward here
    "actor_rollout_ref.model.path": (lambda lr, ac: {lr.model_path, ac.model_path}, lambda v: {v}),
    "actor_rollout_ref.actor.optim.lr": (lambda lr, ac: lr.optimizer.lr, lambda v: v),
    "actor_rollout_ref.model.use_remove_padding": (lambda lr, ac: lr.packing, lambda v: v),
    "actor_rollout_ref.actor.ppo_mini_batch_size": (lambda lr, ac: lr.mini_batch_groups, lambda v: v),
    "actor_rollout_ref.actor.use_kl_loss": (lambda lr, ac: lr.kl_loss_coef > 0, lambda v: v),
    "actor_rollout_ref.actor.kl_loss_coef": (lambda lr, ac: lr.kl_loss_coef, lambda v: v),
    "actor_rollout_ref.actor.kl_loss_type": (lambda lr, ac: lr.kl_loss_type, lambda v: v),
    "actor_rollout_ref.actor.entropy_coeff": (lambda lr, ac: lr.entropy_coeff, lambda v: v),
    "actor_rollout_ref.model.enable_gradient_checkpointing": (
        lambda lr, ac: lr.gradient_checkpointing,
        lambda v: v,
    ),
    "actor_rollout_ref.actor.fsdp_config.param_offload": (lambda lr, ac: lr.fsdp.cpu_offload, lambda v: v),
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload": (
        lambda lr, ac: lr.fsdp.cpu_offload,
        lambda v: v,
    ),
    "actor_rollout_ref.rollout.n": (lambda lr, ac: ac.sampling.n, lambda v: v),
    "actor_rollout_ref.ref.fsdp_config.param_offload": (lambda lr, ac: lr.reference.cpu_offload, lambda v: v),
    "trainer.project_name": (lambda lr, ac: lr.tracking.wandb.project, lambda v: v),
    "trainer.experiment_name": (lambda lr, ac: lr.tracking.wandb.run_name, lambda v: v),
    "trainer.save_freq": (lambda lr, ac: lr.checkpoint.checkpoint_every, lambda v: v),
    "trainer.test_freq": (lambda lr, ac: ac.eval.every_versions / VERSIONS_PER_STEP(lr, ac), lambda v: v),
    "trainer.total_epochs": (
        lambda lr, ac: (ac.dataset.max_epochs, lr.max_steps),
        lambda v: (v, v * (GSM8K_TRAIN // 1024)),
    ),
    "actor_rollout_ref.actor.clip_ratio_low": (lambda lr, ac: lr.clip_ratio_low, lambda v: v),
    "actor_rollout_ref.actor.clip_ratio_high": (lambda lr, ac: lr.clip_ratio_high, lambda v: v),
    "actor_rollout_ref.actor.clip_ratio_c": (lambda lr, ac: lr.clip_ratio_c, lambda v: v),
    "actor_rollout_ref.actor.loss_agg_mode": (lambda lr, ac: lr.loss_agg_mode, lambda v: v),
    "actor_rollout_ref.actor.ppo_epochs": (lambda lr, ac: lr.ppo_epochs, lambda v: v),
    "actor_rollout_ref.actor.grad_clip": (lambda lr, ac: lr.grad_clip, lambda v: v),
    "actor_rollout_ref.actor.optim.weight_decay": (lambda lr, ac: lr.optimizer.weight_decay, lambda v: v),
    "actor_rollout_ref.actor.optim.betas": (lambda lr, ac: tuple(lr.optimizer.betas), tuple),
    "actor_rollout_ref.actor.optim.lr_warmup_steps": (
        lambda lr, ac: lr.optimizer.warmup_steps,
        lambda v: max(v, 0),  # -1: none (ratio 0.0 too)
    ),
    "actor_rollout_ref.actor.optim.lr_scheduler_type": (lambda lr, ac: lr.optimizer.decay, lambda v: v),
    "actor_rollout_ref.rollout.temperature": (lambda lr, ac: ac.sampling.temperature, lambda v: v),
    "actor_rollout_ref.rollout.top_p": (lambda lr, ac: ac.sampling.top_p, lambda v: v),
    "actor_rollout_ref.rollout.top_k": (lambda lr, ac: ac.sampling.top_k, lambda v: v),
    "actor_rollout_ref.rollout.val_kwargs.n": (lambda lr, ac: ac.eval.samples_per_prompt, lambda v: v),
    "actor_rollout_ref.rollout.val_kwargs.do_sample": (lambda lr, ac: not ac.eval.greedy, lambda v: v),
    "actor_rollout_ref.rollout.val_kwargs.temperature": (
        lambda lr, ac: 0 if ac.eval.greedy else ac.sampling.temperature,
        lambda v: v,
    ),
    "algorithm.norm_adv_by_std_in_grpo": (lambda lr, ac: lr.norm_adv_by_std_in_grpo, lambda v: v),
    "algorithm.rollout_correction.rollout_is": (lambda lr, ac: lr.rollout_correction.rollout_is, lambda v: v),
    "algorithm.rollout_correction.rollout_rs": (lambda lr, ac: lr.rollout_correction.rollout_rs, lambda v: v),
    "algorithm.rollout_correction.bypass_mode": (
        lambda lr, ac: lr.rollout_correction.bypass_mode,
        lambda v: v,
    ),
    "data.shuffle": (lambda lr, ac: ac.dataset.shuffle, lambda v: v),
    "trainer.val_before_train": (lambda lr, ac: ac.eval is not None, lambda v: v),  # the first version held
    "trainer.max_actor_ckpt_to_keep": (  # null: keep all of the run's checkpoints
        lambda lr, ac: lr.checkpoint.keep_checkpoints >= lr.max_steps // lr.checkpoint.checkpoint_every,
        lambda v: v is None,
    ),
}
CANNOT_MATCH = {  # verl key: the words of the recipe's "Cannot match" list that explain it
    "actor_rollout_ref.rollout.tensor_model_parallel_size": "rollout.tensor_model_parallel_size 2",
    "actor_rollout_ref.rollout.gpu_memory_utilization": "gpu_memory_utilization 0.6",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": "ppo_micro_batch_size_per_gpu 40",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": "the log-prob micro-batches",
    "trainer.n_gpus_per_node": "Colocation",
    "trainer.nnodes": "One 8-GPU host",
    "trainer.logger": "trainer.logger console",
}


def verl_defaults() -> dict[str, Any]:
    """The defaults of DEFAULTS, from the installed verl 0.9.1's generated trainer config."""
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("verl's sources (make install puts them there)")
    folder = Path(next(iter(spec.submodule_search_locations)))
    config = yaml.safe_load((folder / "trainer" / "config" / "_generated_ppo_trainer.yaml").read_text())
    out = {}
    for key in DEFAULTS:
        node = config
        for part in key.split("."):
            node = node[part]
        out[key] = node
    return out


@pytest.fixture
def recipe() -> tuple[Any, Any]:
    return load_learner_config(RECIPE / "learner.yaml", {}), load_actor_config(RECIPE / "actor.yaml", {})


def test_every_key_of_verls_example_is_the_recipes_or_named_as_cannot_match(recipe):
    learner, actor = recipe
    header = " ".join((RECIPE / "learner.yaml").read_text().split())
    verl = EXAMPLE | verl_defaults()
    rows = []
    for key, value in verl.items():
        if key in CANNOT_MATCH:
            assert key not in MAP, key
            assert CANNOT_MATCH[key] in header, f"{key}: the recipe does not say why it cannot match"
            rows.append((key, value, "cannot match"))
            continue
        ours, theirs = MAP[key]
        assert ours(learner, actor) == theirs(value), (key, ours(learner, actor), theirs(value))
        rows.append((key, value, ours(learner, actor)))
    assert set(MAP) | set(CANNOT_MATCH) == set(verl)
    print("\n".join(f"{k:60} {v!s:28} {o}" for k, v, o in rows))  # side by side, under -s


def test_the_recipe_trains_every_group_once_and_drops_none_it_was_paced_for(recipe):
    """One step ahead at most (max_ahead = one step of groups) and a bound that keeps such groups: a step
    ahead is VERSIONS_PER_STEP versions, plus the step's own mini-batches."""
    learner, actor = recipe
    per_step = VERSIONS_PER_STEP(learner, actor)
    assert actor.buffer.max_ahead == learner.groups_per_step
    assert learner.buffer.max_staleness == actor.buffer.max_staleness == per_step + (per_step - 1)
    assert learner.buffer.max_times_sampled == 1 and learner.buffer.sampler == "fifo"
    assert actor.reward.name == "verl.utils.reward_score.default_compute_score"


def clear_offpolicy_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """None of this machine's OFFPOLICY_* variables reach the check (its overrides line says none)."""
    for key in [k for k in os.environ if k.startswith("OFFPOLICY_")]:
        monkeypatch.delenv(key)


@pytest.fixture
def host_paths(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """The model's config.json in a folder and verl's GSM8K train/test parquet in another, as on a user's
    machine; whatever of verl the check imported leaves sys.modules after."""
    model = write_config(tmp_path / "Qwen2-7B-Instruct", QWEN_7B_CONFIG)  # Qwen2-7B: Qwen2.5-7B's shape
    data = tmp_path / "gsm8k"
    data.mkdir()
    for split in ("train", "test"):
        pq.write_table(pa.Table.from_pylist(verl_rows()), data / f"{split}.parquet")
    before = set(sys.modules)
    yield model, data
    for name in set(sys.modules) - before:
        if name == "verl" or name.startswith("verl."):
            del sys.modules[name]


def test_the_recipe_passes_config_check_with_host_paths_on_its_4_learner_gpus(
    host_paths, capsys, monkeypatch
):
    model, data = host_paths
    clear_offpolicy_env(monkeypatch)
    argv = ["config", "check", str(RECIPE / "learner.yaml"), str(RECIPE / "actor.yaml"), "--gpus", "4"]
    assert main([*argv, "--gpu-memory-gib", "80", "--model-dir", str(model), "--data", str(data)]) == 0
    out = capsys.readouterr().out
    assert (
        f"overrides read: OFFPOLICY_MODEL_PATH={model}, OFFPOLICY_DATASET__PATH={data / 'train.parquet'}, "
        f"OFFPOLICY_EVAL__DATASET__PATH={data / 'test.parquet'}; from the environment: none"
    ) in out
    assert "reward: verl.utils.reward_score.default_compute_score (signature verl)" in out
    assert f"dataset: {data / 'train.parquet'}: the first 3 records read, 3 with an answer" in out
    assert f"eval.dataset: {data / 'test.parquet'}: the first 3 records read" in out
    assert "per rank on 4 GPU(s) (FSDP2" in out and "fits 90% of 80 GiB" in out
    planned = re.search(r"memory plan: ([\d.]+) GiB per rank on 4 GPU", out).group(1)
    page = " ".join((ROOT / "docs" / "coming-from-verl.md").read_text().split())
    assert f"plans the learner at {planned} GiB per rank on 4 GPUs" in page  # the page quotes the check
    assert "eval.every_versions 20 = 5 learner step(s)" in out
    # without the host paths the same check names the container's paths it could not read
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "dataset.path: /var/lib/offpolicy/data/train.parquet is not a file or folder here" in err


def test_the_recipe_env_names_its_files_and_verls_scorer_package():
    env = read_env_file(RECIPE / ".env")
    assert set(env) <= set(read_env_file(ROOT / ".env.example")), set(env) - set(
        read_env_file(ROOT / ".env.example")
    )
    assert env["LEARNER_CONFIG"] == "./configs/recipes/verl-gsm8k-grpo/learner.yaml"
    assert (ROOT / env["ACTOR_CONFIG"]).exists() and env["REWARD_PACKAGES_NO_DEPS"] == "verl==0.9.1"
    assert env["OFFPOLICY_MODEL"] == load_actor_config(ROOT / env["ACTOR_CONFIG"], {}).model_path


def test_code_puts_the_reward_folder_on_the_import_path_as_compose_mounts_it(host_paths, capsys, monkeypatch):
    """The recommended recipe's reward lives in examples/verl (compose: OFFPOLICY_CODE_DIR): `--code`
    imports it; a dataset file for `--data` is the training set's path."""
    model, data = host_paths
    clear_offpolicy_env(monkeypatch)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "gsm8k_reward", raising=False)
    recipe = ROOT / "configs" / "recipes" / "qwen2.5-7b-gsm8k"
    argv = ["config", "check", str(recipe / "learner.yaml"), str(recipe / "actor.yaml"), "--gpus", "4"]
    argv += ["--model-dir", str(model), "--data", str(data / "train.parquet")]
    assert main(argv) == 1  # the reward module is not importable
    assert "reward.name: reward 'gsm8k_reward.compute_score': cannot import" in capsys.readouterr().err
    assert main([*argv, "--code", str(ROOT / "examples" / "verl")]) == 0
    out = capsys.readouterr().out
    assert f"--code: {ROOT / 'examples' / 'verl'} on the import path" in out
    assert f"OFFPOLICY_DATASET__PATH={data / 'train.parquet'}; from the environment: none" in out
    sys.modules.pop("gsm8k_reward", None)


def test_the_sizes_the_page_and_the_env_quote_are_what_sizing_computes_from_the_recipe(host_paths, capsys):
    """`deploy/sizing.py --learner --actor --model-dir` on the recipe: the Redis maxmemory of its .env, the
    learner GPUs the compose layout gives it (at least the fewest that fit), and the page's quoted lines."""
    from deploy import sizing

    model, _ = host_paths
    args = ["--learner", str(RECIPE / "learner.yaml"), "--actor", str(RECIPE / "actor.yaml")]
    assert sizing.main([*args, "--model-dir", str(model)]) == 0
    out = capsys.readouterr().out
    env = read_env_file(RECIPE / ".env")
    assert f"maxmemory {env['REDIS_MAXMEMORY']} (REDIS_MAXMEMORY)" in out
    gpus = int(re.search(r"learner GPUs: (\d+) of 80 GiB", out).group(1))
    assert gpus <= 4  # docker-compose.8gpu.yml's learner ranks
    page = " ".join((ROOT / "docs" / "coming-from-verl.md").read_text().split())
    for line in out.splitlines()[1:]:
        assert line in page, f"the page does not quote: {line}"
