"""What a holder or a waiter that went away leaves behind is reclaimed, and the room goes
to the FIFO head at once: a lease past its TTL, a waiter that stopped polling (its liveness
deadline), a grant nobody claimed (its claim deadline). On fakeredis and a real
redis-server, with the scripts' clock injected."""
from __future__ import annotations

import pytest

from _gatehelpers import engines, ledger, mkgate, script


def test_lease_ttl_reclaim(backend, clock):
    g = mkgate(backend, clock, lease_ttl_s=10)
    g.write_snapshot(engines())
    g.acquire("s", prompt_tokens=100, max_new_tokens=0, retain_session=False)
    clock.advance(9)
    g.write_snapshot(engines())
    assert g.housekeep()["leases"] == 0 and ledger(g) == 100
    clock.advance(2)
    assert g.housekeep()["leases"] == 1
    assert ledger(g) == 0
    assert g.step_metrics()["agentic_kv/budget/lease_expired"] == 1


def test_dead_waiter_does_not_block_the_head(backend, clock):
    g = mkgate(backend, clock, headroom=1.0, residency=False, wait_poll_s=1.0, max_wait_s=60)
    g.write_snapshot(engines(cap=100))
    script(g, "acquire", ticket="a", session="a", need=100, probe=-2)
    assert script(g, "acquire", ticket="dead", session="d", need=60, probe=-2)["o"] == "wait"
    clock.advance(2)
    # it would not fit either: the ledger reason wins over "queued"
    assert script(g, "acquire", ticket="live", session="l", need=60, probe=-2)["r"] == "capacity_exhausted"
    clock.advance(1.5)  # "dead" missed its polls: liveness (2 polls + 1 s) passed
    g.write_snapshot(engines(cap=100))
    script(g, "acquire", ticket="live", session="l", need=60, probe=-2)  # its own poll
    script(g, "release", ticket="a")
    assert g.redis.hget(g.key("leases"), "live") is not None
    assert g.redis.hget(g.key("leases"), "dead") is None


def test_unclaimed_grant_is_reclaimed(backend, clock):
    g = mkgate(backend, clock, headroom=1.0, residency=False, wait_poll_s=1.0)
    g.write_snapshot(engines(cap=100))
    script(g, "acquire", ticket="a", session="a", need=100, probe=-2)
    script(g, "acquire", ticket="b", session="b", need=50, probe=-2)
    script(g, "release", ticket="a")
    assert ledger(g) == 50
    clock.advance(3.1)  # claim deadline (2 polls + 1 s) passed; b's process is gone
    g.write_snapshot(engines(cap=100))
    assert g.housekeep()["leases"] == 1 and ledger(g) == 0


@pytest.mark.parametrize("how", ["probe", "protected"])
def test_room_an_acquire_reclaims_goes_to_the_fifo_head_at_once(backend, how, clock):
    # B's record outlives the 2.5 s
    g = mkgate(backend, clock, max_wait_s=30.0, headroom=1.0, lease_ttl_s=2.0, wait_poll_s=5.0)
    g.write_snapshot(engines(usage=0.1, cap=1000))
    assert script(g, "acquire", ticket="A", session="a", need=900, probe=0.0, retain=0)["o"] == "admit"
    assert script(g, "acquire", ticket="B", session="b", need=500, probe=0.0, retain=0)["o"] == "wait"
    clock.advance(2.5)  # A's lease expires (its holder died); the snapshot is still fresh
    extra = dict(probe=-1) if how == "probe" else dict(probe=0.0, protected=1)
    r = script(g, "acquire", ticket="C", session="c", need=100, retain=0, **extra)
    assert r["o"] == ("probe" if how == "probe" else "bypass")
    # C's reclaim freed A's 900 tokens: B is granted now, not at its own next poll
    assert g.redis.zcard(g.key("fifo")) == 0
    assert g.redis.hexists(g.key("leases"), "B")


@pytest.mark.parametrize("dies", ["waiting", "holding"])
def test_a_dead_sessions_preemption_count_goes_with_what_is_reclaimed(backend, clock, dies):
    # a session's count is kept until finish_session; a process that died never sends it, so
    # the reclaim of its last attempt (a waiter past liveness, a lease past its TTL) forgets
    # the count, or the preempted hash would grow by one field per such session for ever
    g = mkgate(backend, clock, headroom=1.0, residency=False, wait_poll_s=1.0, lease_ttl_s=10.0)
    g.write_snapshot(engines(cap=100))
    holder = g.acquire("a", prompt_tokens=100, max_new_tokens=0, retain_session=False)
    attempts = []
    for ticket in ("old", "new"):  # a retry of the turn preempts its waiting first attempt
        attempts.append(script(g, "acquire", ticket=ticket, session="d", need=60, probe=-2)["o"])
        clock.advance(0.1)
    assert (attempts, g.num_preempted("d")) == (["wait", "wait"], 1)
    if dies == "holding":
        holder.release()  # "new" is granted: its process claims it, then dies
        assert script(g, "acquire", ticket="new", session="d", need=60, probe=-2)["o"] == "admit"
        clock.advance(11)
    else:
        clock.advance(3.5)  # "new" missed its polls (2 polls + 1 s)
    g.write_snapshot(engines(cap=100))
    g.housekeep()
    assert g.num_preempted("d") == 0 and not g.redis.hexists(g.key("preempted"), "d")
    assert g.redis.hlen(g.key("waiters")) == 0 and g.redis.hlen(g.key("leases")) == (0 if dies == "holding" else 1)
