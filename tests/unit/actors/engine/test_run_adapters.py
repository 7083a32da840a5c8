"""One engine's adapters for several runs (an actor pool), on the stand-in for vLLM's `AsyncLLM`: one id
counter for the whole engine, names that carry the run, each run's requests on its own newest adapter and
version, the capacity shared by all runs (never giving up another run's newest), and a run dropped with its
adapters."""

from __future__ import annotations

import asyncio

import pytest

from offpolicy.actors.engine.adapters import AdapterTable
from tests.unit.actors.engine.conftest import source
from tests.unit.actors.engine.test_adapters import lora_engine, settle

pytestmark = pytest.mark.usefixtures("stand_in_adapter_files")


def test_runs_share_one_id_counter_and_each_request_carries_its_own_runs_newest_adapter():
    async def scenario():
        engine, llm = lora_engine(max_cpu_loras=8)
        a = await engine.add_run("run-a")
        b = await engine.add_run("run-b")
        c = await engine.add_run("run-c", base_version=5)  # no adapter yet: the base, as its version 5
        await a.load_adapter("/a/v1", 1)
        await b.load_adapter("/b/v1", 1)
        await a.load_adapter("/a/v2", 2)
        added = [(r.lora_int_id, r.lora_name, source(r)) for r in llm.added]
        assert added == [(1, "run-a-v1-1", "/a/v1"), (2, "run-b-v1-2", "/b/v1"), (3, "run-a-v2-3", "/a/v2")]
        requests = {
            rid: asyncio.create_task(view.generate_group(rid, [1, 2], None))
            for rid, view in (("ra", a), ("rb", b), ("rc", c))
        }
        await settle()
        assert llm.carried["ra"].lora_int_id == 3 and llm.carried["rb"].lora_int_id == 2
        assert llm.carried["rc"] is None
        for event in llm.release.values():
            event.set()
        versions = {rid: [c.versions.tolist() for c in await t] for rid, t in requests.items()}
        assert versions == {"ra": [[2, 2, 2]] * 2, "rb": [[1, 1, 1]] * 2, "rc": [[5, 5, 5]] * 2}
        assert (a.loaded_version, b.loaded_version, c.loaded_version) == (2, 1, 5)
        assert (a.loaded_path, b.loaded_path, c.loaded_path) == ("/a/v2", "/b/v1", "/base")
        assert engine.loaded_version == 0, "the engine's own version is not a run's"
        assert a.adapters.status() == {"adapter_version": 2, "adapters_loaded": [2]}  # a's v1 was unused
        assert llm.removed == [1] and engine.adapter_table.held == 2

    asyncio.run(scenario())


def test_past_the_capacity_the_oldest_superseded_adapter_of_any_run_goes_never_another_runs_newest():
    async def scenario():
        engine, llm = lora_engine(max_cpu_loras=4)
        a, b = await engine.add_run("run-a"), await engine.add_run("run-b")
        await a.load_adapter("/a/v1", 1)  # id 1
        a1 = asyncio.create_task(a.generate_group("a1", [1], None))
        await settle()
        await b.load_adapter("/b/v1", 1)  # id 2
        b1 = asyncio.create_task(b.generate_group("b1", [1], None))
        await settle()
        await a.load_adapter("/a/v2", 2)  # id 3
        await b.load_adapter("/b/v2", 2)  # id 4: four held, each run's newest and one in use
        assert llm.aborted == [] and engine.adapter_table.held == 4
        await a.load_adapter("/a/v3", 3)  # one too many: the oldest superseded is a's v1 (id 1)
        assert llm.aborted == ["a1"] and [c.finish_reason for c in await a1] == ["abort"] * 2
        await settle()
        assert 1 in llm.removed and b.adapters.status()["adapters_loaded"] == [1, 2]
        await a.load_adapter("/a/v4", 4)  # a's v2, v3 unused (removed at once); b's v1 still in use: kept
        assert llm.aborted == ["a1"] and b.adapters.status()["adapters_loaded"] == [1, 2]
        llm.release["b1"].set()
        await b1

    asyncio.run(scenario())


def test_with_room_for_one_adapter_per_run_a_new_version_never_takes_another_runs_newest():
    async def scenario():
        engine, llm = lora_engine(max_cpu_loras=2)
        a, b = await engine.add_run("run-a"), await engine.add_run("run-b")
        await a.load_adapter("/a/v1", 1)
        await b.load_adapter("/b/v1", 1)
        b1 = asyncio.create_task(b.generate_group("b1", [1], None))
        a1 = asyncio.create_task(a.generate_group("a1", [1], None))
        await settle()
        await a.load_adapter("/a/v2", 2)  # only a's own newest can make way
        assert llm.aborted == ["a1"] and [c.finish_reason for c in await a1] == ["abort"] * 2
        await settle()
        assert b.adapters.status()["adapters_loaded"] == [1] and a.adapters.status()["adapters_loaded"] == [2]
        llm.release["b1"].set()
        assert [c.versions.tolist() for c in await b1] == [[1, 1, 1]] * 2

    asyncio.run(scenario())


def test_a_dropped_run_loses_its_requests_and_adapters_and_the_others_keep_theirs():
    async def scenario():
        engine, llm = lora_engine()
        a, b = await engine.add_run("run-a"), await engine.add_run("run-b")
        await a.load_adapter("/a/v1", 1)
        await b.load_adapter("/b/v1", 1)
        a1 = asyncio.create_task(a.generate_group("a1", [1], None))
        await settle()
        await a.load_adapter("/a/v2", 2)  # v1 in use by a1, v2 newest
        await engine.drop_run("run-a")
        assert llm.aborted == ["a1"] and sorted(llm.removed) == [1, 3]
        assert [c.finish_reason for c in await a1] == ["abort"] * 2
        await settle()
        assert sorted(llm.removed) == [1, 3], "a request's end after the drop removes nothing again"
        assert list(engine.adapter_table.runs) == [None, "run-b"] and engine.adapter_table.held == 1
        with pytest.raises(ValueError, match="already served"):
            await engine.add_run("run-b")
        again = await engine.add_run("run-a")  # a run id may come back: new adapters, new ids
        await again.load_adapter("/a/v2", 2)
        assert llm.added[-1].lora_int_id == 4 and llm.added[-1].lora_name == "run-a-v2-4"

    asyncio.run(scenario())


def test_an_engine_of_full_weights_serves_no_runs():
    async def scenario():
        engine, _ = lora_engine()
        engine.lora, engine.kind = None, "full"
        with pytest.raises(ValueError, match=r"engine\.lora"):
            await engine.add_run("run-a")

    asyncio.run(scenario())


def test_stale_counts_every_run_and_orders_by_the_engine_wide_load_order():
    table = AdapterTable(capacity=3)
    a, b = table.add_run("a"), table.add_run("b")

    def load(run, version):
        request = type("R", (), {"lora_int_id": table.next_id(), "lora_name": "x"})()
        run.add(version, request)
        return run.newest

    old_b = load(b, 1)
    old_b.users.add("rb")  # in use: kept when superseded
    load(a, 1).users.add("ra")
    load(b, 2)
    assert table.held == 3 and [x.lora_id for x in table.stale(a)] == [1]  # b's v1 is older than a's v1
    assert [x.lora_id for x in table.stale(b)] == [1]
