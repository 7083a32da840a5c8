"""The embedded redis-server when its port is taken between choosing and binding it: it never mistakes the
server already on the port for itself, and with no port given it tries another."""

from __future__ import annotations

import pytest
import redis

from offpolicy.buffer import embedded
from offpolicy.buffer.embedded import EmbeddedRedis, PortTaken

pytestmark = pytest.mark.redis


def test_a_taken_port_is_not_mistaken_for_ours_and_another_is_tried(tmp_path, monkeypatch):
    with EmbeddedRedis.start(tmp_path / "first") as first:
        with pytest.raises(PortTaken):  # a port given explicitly: the error, not the other server
            EmbeddedRedis.start(tmp_path / "second", port=first.port)
        ports = iter([first.port, embedded.free_port()])
        monkeypatch.setattr(embedded, "free_port", lambda: next(ports))
        with EmbeddedRedis.start(tmp_path / "third") as third:
            assert third.port != first.port
            with redis.Redis.from_url(third.url) as c:
                assert int(c.info("server")["process_id"]) == third.pid
