"""benchmarks/learner_longtail.py's `run_shape`, run twice in one process as `--levers` does: the first
row's learner is gone before the second is built. A `Learner` is held by reference cycles, so without a
collection it outlives `run_shape` with its weights and Adam state (48 GB at 4B); on the H200 the next
rows ran beside what was left of it: one row's peak read 17 GiB high, and the rows whose plans fill the
device ran out of memory."""

from __future__ import annotations

import argparse
import gc
import weakref

import pytest

import learner_longtail

pytestmark = pytest.mark.redis


def smoke_args(model_dir) -> argparse.Namespace:
    return argparse.Namespace(
        shape="longtail-4b", smoke=True, device="cpu", model_dir=str(model_dir), precision=None,
        packing="on", threads=None, attention=None, logprob_head=None, gradient_checkpointing=None,
        micro_batch_tokens=None, no_grad_micro_batch_tokens=None, steps=1, profile=False,
    )  # fmt: skip


def test_a_row_starts_with_no_earlier_learner_alive(monkeypatch, tmp_path):
    learners: list[weakref.ref] = []
    alive_at_build: list[int] = []
    build = learner_longtail.Learner

    def tracked(cfg):
        alive_at_build.append(sum(ref() is not None for ref in learners))
        learner = build(cfg)
        learners.append(weakref.ref(learner))
        return learner

    monkeypatch.setattr(learner_longtail, "Learner", tracked)
    gc.disable()  # the collector must not run by chance between the rows: the benchmark must collect
    try:
        outs = [learner_longtail.run_shape(smoke_args(tmp_path / "model")) for _ in range(2)]
        assert alive_at_build == [0, 0]
        assert all(ref() is None for ref in learners)  # the last row's too, once `run_shape` returned
    finally:
        gc.enable()
    assert [o["resident_gib_at_start"] for o in outs] == [None, None]  # CPU: nothing to read


def test_without_the_collection_the_first_learner_outlives_its_row(monkeypatch, tmp_path):
    """The reason for the collection: the cycles are real (if they went away, this test says so)."""
    learners: list[weakref.ref] = []
    build = learner_longtail.Learner

    def tracked(cfg):
        learner = build(cfg)
        learners.append(weakref.ref(learner))
        return learner

    monkeypatch.setattr(learner_longtail, "Learner", tracked)
    monkeypatch.setattr(learner_longtail.gc, "collect", lambda *a: 0)
    gc.disable()
    try:
        learner_longtail.run_shape(smoke_args(tmp_path / "model"))
        assert learners[0]() is not None
    finally:
        gc.enable()
        gc.collect()
