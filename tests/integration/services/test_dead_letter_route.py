"""`GET /v1/dead_letters` on a learner service whose buffer is a real `ReplayBuffer` on Redis 6.2."""

from __future__ import annotations

import pytest
import redis
from fastapi.testclient import TestClient

from offpolicy.buffer.config import BufferConfig
from offpolicy.buffer.keys import BufferKeys
from offpolicy.buffer.replay_buffer import ReplayBuffer
from offpolicy.learner.config import LearnerConfig
from offpolicy.services.common.settings import LearnerServiceSettings
from offpolicy.services.learner_api.main import create_app
from tests.conftest import build_group
from tests.unit.services.learner_api.test_routes import TOKEN, FakeLearner

pytestmark = pytest.mark.redis


def test_dead_letters_route_lists_the_buffer_dead_letters(redis_url, run_id) -> None:
    buffer = ReplayBuffer(redis_url, run_id, BufferConfig.queue())

    def factory(config, registry, on_applied) -> FakeLearner:
        learner = FakeLearner(config, registry, on_applied)
        learner.buffer = buffer  # the real buffer; the loop itself is the hermetic fake
        return learner

    groups = [build_group(0, seed=i) for i in range(3)]
    buffer.insert_many(groups)
    with redis.Redis.from_url(redis_url) as raw:
        raw.set(BufferKeys.for_run(run_id).payload(groups[0].group_id), b"not a frame")
    leased = buffer.lease(3, 0, consumer="learner-0", lease_s=60)
    buffer.dead_letter(
        "learner-0", leased.lease_ids[0], "token id 99999 >= vocab_size", "trajectories[1].response_ids"
    )
    config = LearnerConfig(model_path="/models/tiny", redis_url=redis_url)
    app = create_app(LearnerServiceSettings(api_token=TOKEN), config=config, learner_factory=factory)
    try:
        with TestClient(app) as client:
            body = client.get("/v1/dead_letters").json()
            one = client.get("/v1/dead_letters", params={"limit": 1}).json()
            assert client.get("/v1/dead_letters", params={"limit": 0}).status_code == 422
    finally:
        buffer.clear()
        buffer.close()
    entries = body["entries"]
    assert [e["field"] for e in entries] == ["trajectories[1].response_ids", "payload"]
    assert entries[0]["group_id"] == leased.groups[0].group_id and entries[0]["consumer"] == "learner-0"
    assert entries[1]["group_id"] == groups[0].group_id and entries[1]["reason"].startswith("decode: ")
    assert one["entries"] == entries[:1]
