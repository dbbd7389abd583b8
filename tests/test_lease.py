"""kvgate/control/lease.py alone, against a real redis-server: the poller's leader lease."""
from __future__ import annotations

import asyncio
import logging

import pytest
import redis

import kvgate.control.lease
from kvgate.control.call_threads import CallThreads
from kvgate.control.lease import LeaderLease, leader_key

pytestmark = pytest.mark.redis_real


@pytest.fixture
def client(redis_url):
    c = redis.Redis.from_url(redis_url, socket_timeout=2.0)
    yield c
    c.close()


def lease(client, identity: str, ttl_s: float = 5.0) -> LeaderLease:
    return LeaderLease(client, "lg", identity=identity, ttl_s=ttl_s, calls=CallThreads(bound_s=ttl_s / 3))


def test_one_holder_at_a_time_and_release_hands_over(client, caplog):
    a, b = lease(client, "A"), lease(client, "B")
    assert a.holder() is None
    with caplog.at_level(logging.INFO, logger="kvgate.control.poller"):
        assert asyncio.run(a.hold())
    assert "poller A is now LEADER" in caplog.text  # under the poller's logger, as before the split
    assert not asyncio.run(b.hold())
    assert client.get(leader_key("lg")) == b"A" and b.holder() == "A"
    assert asyncio.run(a.hold()) and a.held  # extends its own
    a.release()
    assert not a.is_leader and not a.held and a.holder() is None
    assert asyncio.run(b.hold()) and b.holder() == "B"
    assert not asyncio.run(a.hold())
    assert (a.changes, b.changes) == (1, 1)  # each gained it once (giving it up is no change)


def test_held_runs_out_with_the_ttl_on_the_lease_s_own_clock(client, monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(kvgate.control.lease, "_monotonic", lambda: now[0])
    a = lease(client, "A", ttl_s=2.0)
    assert asyncio.run(a.hold()) and a.held
    now[0] += 1.9
    assert a.held
    now[0] += 0.2
    assert a.is_leader and not a.held  # may be another's by now: the gauge must not say it leads


def test_keep_alive_holds_the_lease_past_its_ttl_and_stops_when_it_is_lost(client):
    a, b = lease(client, "A", ttl_s=1.0), lease(client, "B", ttl_s=1.0)

    async def main() -> None:
        assert await a.hold()
        keeper = asyncio.create_task(a.keep_alive())
        await asyncio.sleep(2.5)  # 2.5 TTLs: without the keep-alive the key would be gone
        assert client.get(leader_key("lg")) == b"A" and not await b.hold()
        client.delete(leader_key("lg"))  # lost (as after a stall past the TTL), and taken
        assert await b.hold()
        await asyncio.wait_for(keeper, 20)  # it only extends: a lease no longer ours stays lost
        assert not a.held and client.get(leader_key("lg")) == b"B"

    asyncio.run(main())


def test_arelease_gives_the_lease_up_from_the_event_loop(client):
    a, b = lease(client, "A"), lease(client, "B")
    assert asyncio.run(a.hold())
    asyncio.run(a.arelease())
    assert not a.is_leader and client.get(leader_key("lg")) is None
    assert asyncio.run(b.hold())
    asyncio.run(a.arelease())  # not ours: releasing is a no-op
    assert client.get(leader_key("lg")) == b"B"
