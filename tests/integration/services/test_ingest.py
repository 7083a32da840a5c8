"""Groups generated elsewhere reach the buffer over HTTP (`POST /v1/groups`) and the learner trains on
them: a malformed group is rejected with its field, the rest stored; the bearer token is required; the
Python client raises typed errors."""

from __future__ import annotations

import numpy as np
import pytest

from offpolicy.buffer.json_records import group_from_json, group_to_json
from offpolicy.services.client import Invalid, LearnerClient, Unauthorized
from tests.integration.services.test_learner import AUTH, TOKEN, random_group, service, tiny, wait_for  # noqa: F401
from tests.unit.learner.rl.test_microbatches import ragged_groups
from tests.unit.learner.test_env_tokens import with_env

pytestmark = pytest.mark.redis


def test_json_round_trip_keeps_every_field():
    g = with_env(ragged_groups(1, 3, seed=4, response=(8, 12)), seed=5)[0]
    g.trajectories[0].versions = np.arange(len(g.trajectories[0].response_ids), dtype=np.int32)
    back = group_from_json(group_to_json(g))
    assert group_to_json(back) == group_to_json(g)


def test_posted_groups_are_stored_by_field_and_trained_on(service):  # noqa: F811
    client, _ = service
    learner = LearnerClient(http=client, token=TOKEN)
    good = [group_to_json(random_group(0, seed=i)) for i in range(2)]
    masked = group_to_json(with_env(ragged_groups(1, 2, seed=6, response=(8, 12)), seed=7)[0])
    bad_shape = group_to_json(random_group(0, seed=9)) | {"trajectories": "nope"}
    bad_value = group_to_json(random_group(0, seed=10))
    bad_value["trajectories"][1]["behavior_logprobs"][0] = 0.5  # a log-prob > 0
    result = learner.push_groups([*good, masked, bad_shape, bad_value])
    assert sorted(result.inserted) == sorted([good[0]["group_id"], good[1]["group_id"], masked["group_id"]])
    assert result.rejected == {
        bad_shape["group_id"]: "trajectories",
        bad_value["group_id"]: "trajectories[1].behavior_logprobs",
    }
    again = learner.push_groups(good[:1])
    assert again.duplicates == (good[0]["group_id"],) and not again.inserted
    wait_for(lambda: learner.status()["step"] >= 1)  # 2 groups per step: the learner trained on them
    assert learner.status()["buffer"]["rejected_total"] == {"trajectories.behavior_logprobs": 1}


def test_ingest_needs_the_token_and_errors_are_typed(service):  # noqa: F811
    client, _ = service
    body = {"groups": [group_to_json(random_group(0, seed=11))]}
    assert client.post("/v1/groups", json=body).status_code == 401
    with pytest.raises(Unauthorized) as e:
        LearnerClient(http=client, token="wrong").push_groups(body["groups"])
    assert e.value.status == 401 and "wrong" not in str(e.value)
    with pytest.raises(Invalid):
        LearnerClient(http=client, token=TOKEN).push_groups([])  # an empty list is refused whole
    assert client.post("/v1/groups", json=body, headers=AUTH).status_code == 200


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"policy_version": 10**30}, "policy_version"),
        ({"created_at": "now"}, "created_at"),
        ({"prompt_ids": [10**30]}, "prompt_ids"),
        ({"sampling": {"temperature": None}}, "sampling"),
        ({"prompt_id": 7}, "prompt_id"),
    ],
)
def test_hostile_documents_are_rejected_by_field(change, field):
    from offpolicy.buffer.codec import encode_group
    from offpolicy.buffer.errors import InvalidTrajectory

    doc = group_to_json(random_group(0, seed=12)) | change
    with pytest.raises(InvalidTrajectory) as e:
        encode_group(group_from_json(doc))  # what the buffer does with it before anything reaches Redis
    assert e.value.field == field
