"""`publish.transfer.address` is checked when the learner starts: vLLM's rank 0 binds its rendezvous store's
listening socket to it, so an address of another host (a ClusterIP Service's name) would fail every send
later, only logged."""

from __future__ import annotations

import pytest

from offpolicy.learner.transport.address import check_bindable


@pytest.mark.parametrize("address", ["127.0.0.1", "localhost", "0.0.0.0"])
def test_an_address_of_this_host_is_accepted(address):
    check_bindable(address)


def test_an_address_of_another_host_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"publish\.transfer\.address '192\.0\.2\.1'.*headless Service"):
        check_bindable("192.0.2.1")  # TEST-NET-1: never a local address


def test_a_name_that_does_not_resolve_is_refused():
    with pytest.raises(
        ValueError, match=r"publish\.transfer\.address 'no-such-host\.invalid' does not resolve"
    ):
        check_bindable("no-such-host.invalid")


def test_the_transport_refuses_it_at_construction(monkeypatch):
    from offpolicy.learner.transport.vllm import VllmTransport
    from offpolicy.weights.config import TransferConfig

    config = TransferConfig(backend="gloo", address="192.0.2.1")
    with pytest.raises(ValueError, match="not an address of the learner's host"):
        VllmTransport(config, control=None, state=dict, dtype=None)  # type: ignore[arg-type]
