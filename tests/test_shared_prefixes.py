"""Shared prefixes and GRPO groups (docs/concepts.md#shared-prefixes), on fakeredis and on a
real redis-server: a prefix is charged once while any lease or window holds it and given back
by its last holder; siblings waiting behind a group's head enter with it at their marginal
cost; a dead sibling's reclaim leaves the others' shared charge; grouped and ungrouped turns
keep one strict FIFO; the sharing arguments are checked before Redis is touched."""
from __future__ import annotations

import json

import pytest

from _gatehelpers import Clock, engines, ledger, mkgate, script, stat

#: a GRPO task's prompt the samples share
TASK = dict(prefix_key="task-7", prefix_tokens=800)


def _prefix(g, key: str = "task-7"):
    raw = g.redis.hget(g.key("prefixes"), key)
    return json.loads(raw) if raw is not None else None


def _acq(g, ticket: str, session: str, need: int, shared: dict | None = None, **kw) -> dict:
    """One acquire.lua call (a turn whose prompt is need - 100, decode 100), sharing ``shared``
    (the turn's arguments, as the client passes them to the script)."""
    if shared:
        kw["prefixes"] = [[shared["prefix_key"], shared["prefix_tokens"]]]
    return script(g, "acquire", ticket=ticket, session=session, need=need, prompt=need - 100, probe=-2, **kw)


def test_prefix_charged_once_and_freed_by_its_last_holder(backend):
    g = mkgate(backend, Clock())
    g.write_snapshot(engines(cap=10_000))
    a = g.acquire("a", prompt_tokens=1000, max_new_tokens=100, **TASK)
    b = g.acquire("b", prompt_tokens=1000, max_new_tokens=100, **TASK)
    assert (a.reason, b.reason) == ("open", "open")
    # 800 once, plus each sample's own 300 (its unshared 200 prompt tokens and 100 decode)
    assert ledger(g) == 800 + 300 + 300
    assert _prefix(g) == {"t": 800, "h": 2}
    assert stat(g, "group_admit") == 1 and stat(g, "prefix_saved") == 800 and stat(g, "prefix_charged") == 800
    m = g.step_metrics(drain=False)
    assert m["agentic_kv/budget/reserved_unshared"] == 2 * 1100  # what a per-session ledger would hold
    assert m["agentic_kv/sharing/prefixes"] == 1
    from kvgate.control.status import status_parts  # kvgate status shows it
    head = dict(status_parts(g.status())[0])
    assert head["shared prefixes"] == [("1 charged once; 800 not charged again", None)]
    # the windows keep the prefix charged between turns
    a.release()
    b.release()
    assert ledger(g) == 1400 and _prefix(g)["h"] == 2
    assert g.finish_session("a")["freed"] == 300  # the prefix stays: b's window holds it
    assert ledger(g) == 1100 and _prefix(g) == {"t": 800, "h": 1}
    assert g.finish_session("b")["freed"] == 1100  # the last holder gives the prefix back
    assert ledger(g) == 0 and _prefix(g) is None
    assert g.redis.hget(g.key("ledger"), "psaved") in (b"0", None)
    assert stat(g, "ledger_clamped") == 0


def test_turns_without_sharing_are_charged_as_before(backend):
    g = mkgate(backend, Clock())
    g.write_snapshot(engines(cap=10_000))
    g.acquire("a", prompt_tokens=1000, max_new_tokens=100)
    g.acquire("b", prompt_tokens=1000, max_new_tokens=100, prefix_key="task-7", prefix_tokens=0)
    assert ledger(g) == 2200 and g.redis.hlen(g.key("prefixes")) == 0


def test_siblings_waiting_behind_the_head_enter_together(backend):
    clock = Clock()
    g = mkgate(backend, clock, headroom=1.0)
    g.write_snapshot(engines(cap=2000))
    assert _acq(g, "X", "x", 1500)["o"] == "admit"  # fills the ledger
    for i in range(4):  # a group of four samples, each 1,100 tokens of which 800 shared
        assert _acq(g, f"S{i}", f"s{i}", 1100, TASK)["o"] == "wait"
    # X's release leaves room for one session of 1,100 tokens: the head, and its siblings at
    # their own 300 each (1100 + 3 x 300 = 2000)
    script(g, "release", ticket="X")
    leases = {t: json.loads(v) for t, v in g.redis.hgetall(g.key("leases")).items()}
    assert sorted(t.decode() for t in leases) == ["S0", "S1", "S2", "S3"]
    assert g.redis.zcard(g.key("fifo")) == 0
    assert ledger(g) == 800 + 4 * 300 and _prefix(g)["h"] == 4
    # without sharing the same room holds one of them
    g2 = mkgate(backend, clock, gate="g2", headroom=1.0)
    g2.write_snapshot(engines(cap=2000))
    _acq(g2, "X", "x", 1500)
    for i in range(4):
        _acq(g2, f"S{i}", f"s{i}", 1100)
    script(g2, "release", ticket="X")
    assert g2.redis.hlen(g2.key("leases")) == 1 and g2.redis.zcard(g2.key("fifo")) == 3


def test_mixed_grouped_and_ungrouped_turns_keep_strict_fifo_order(backend):
    g = mkgate(backend, Clock(), headroom=1.0)
    g.write_snapshot(engines(cap=4000))
    assert _acq(g, "X", "x", 3500)["o"] == "admit"
    assert _acq(g, "A1", "a1", 1100, TASK)["o"] == "wait"   # fits once X is gone
    assert _acq(g, "U", "u", 3000)["o"] == "wait"            # ungrouped, too big next to A1
    assert _acq(g, "A2", "a2", 1100, TASK)["o"] == "wait"   # a sibling behind U
    script(g, "release", ticket="X")
    leases = {t.decode() for t in g.redis.hkeys(g.key("leases"))}
    # A1 enters; A2 would fit at its own 300, but U is older and does not fit: A2 waits behind it
    assert leases == {"A1"}
    assert [t.decode() for t in g.redis.zrange(g.key("fifo"), 0, -1)] == ["U", "A2"]
    # a new sibling does not pass the waiters either (rule 6 needs an empty FIFO)
    assert _acq(g, "A3", "a3", 1100, TASK)["r"] == "queued"
    script(g, "release", ticket="A1")
    script(g, "finish_session", session="a1")  # the prefix's last holder: its 800 come back
    assert {t.decode() for t in g.redis.hkeys(g.key("leases"))} == {"U"}
    assert _prefix(g) is None
    script(g, "release", ticket="U")
    # then the siblings, together: the first charges the prefix again, the second joins it
    assert {t.decode() for t in g.redis.hkeys(g.key("leases"))} == {"A2", "A3"}
    assert _prefix(g) == {"t": 800, "h": 2}


def test_a_dead_siblings_lease_is_reclaimed_without_freeing_the_shared_charge(backend):
    clock = Clock()
    g = mkgate(backend, clock, lease_ttl_s=10.0, idle_grace_s=60.0)
    g.write_snapshot(engines(cap=10_000))
    assert _acq(g, "A", "a", 1100, TASK, retain=1)["o"] == "admit"  # a window holds the prefix
    clock.advance(5)
    assert _acq(g, "B", "b", 1100, TASK)["o"] == "admit"  # a lease of its own holds it too
    assert ledger(g) == 1400 and _prefix(g)["h"] == 2
    script(g, "release", ticket="A")  # A's window goes idle, still charged
    clock.advance(11)  # past B's lease TTL (10 s): its holder died without a release
    g.write_snapshot(engines(cap=10_000))
    out = g.housekeep()
    assert out["leases"] == 1 and stat(g, "lease_expired") == 1
    # B's own 300 came back; the prefix stays charged for A's window
    assert ledger(g) == 1100 and _prefix(g) == {"t": 800, "h": 1}
    assert g.finish_session("a")["freed"] == 1100 and ledger(g) == 0


def test_nested_prefixes_charge_a_system_prompt_once_under_every_task(backend):
    g = mkgate(backend, Clock())
    g.write_snapshot(engines(cap=10_000))

    def sample(session: str, task: str):
        # a 200-token system prompt, then the task's 600 tokens on it; 200 own prompt tokens, 100 decode
        return g.acquire(session, prompt_tokens=1000, max_new_tokens=100, prefix_key=["system", task],
                         prefix_tokens=[200, 800])

    sample("a1", "task-a")
    assert ledger(g) == 200 + 600 + 300
    sample("a2", "task-a")
    sample("b1", "task-b")  # a new task: only its own 600 on the system prompt
    assert ledger(g) == 200 + 2 * 600 + 3 * 300
    assert _prefix(g, "system") == {"t": 200, "h": 3} and _prefix(g, "task-b") == {"t": 600, "h": 1}
    assert stat(g, "group_admit") == 2 and stat(g, "prefix_saved") == 800 + 200
    for s in ("a1", "a2"):
        g.finish_session(s)
    assert _prefix(g, "task-a") is None and _prefix(g, "system") == {"t": 200, "h": 1}
    assert g.finish_session("b1")["freed"] == 300 + 600 + 200
    assert ledger(g) == 0 and g.redis.hlen(g.key("prefixes")) == 0


def test_a_session_whose_next_turn_names_another_prefix_moves_its_hold(backend):
    g = mkgate(backend, Clock())
    g.write_snapshot(engines(cap=10_000))
    lease = g.acquire("a", prompt_tokens=1000, max_new_tokens=100, **TASK)
    g.acquire("b", prompt_tokens=1000, max_new_tokens=100, **TASK)
    lease.release()
    # the session's context was reset: its next turn shares nothing
    g.acquire("a", prompt_tokens=500, max_new_tokens=100)
    assert _prefix(g) == {"t": 800, "h": 1}
    assert ledger(g) == 800 + 300 + 600
    g.finish_session("b")
    assert _prefix(g) is None and ledger(g) == 600


@pytest.mark.parametrize("kw, err", [
    (dict(prefix_key="k"), ValueError),                    # one of the two
    (dict(prefix_tokens=10), ValueError),
    (dict(prefix_key=7, prefix_tokens=10), TypeError),     # not a str
    (dict(prefix_key="", prefix_tokens=10), ValueError),
    (dict(prefix_key="k" * 513, prefix_tokens=10), ValueError),
    (dict(prefix_key="k", prefix_tokens=10.0), TypeError),  # not an int
    (dict(prefix_key="k", prefix_tokens=True), TypeError),
    (dict(prefix_key="k", prefix_tokens=-1), ValueError),
    (dict(prefix_key="k", prefix_tokens=101), ValueError),  # more than the prompt
    (dict(prefix_key=["a", "b"], prefix_tokens=[10]), ValueError),        # nested: as many lengths as keys
    (dict(prefix_key=["a", "a"], prefix_tokens=[10, 20]), ValueError),    # a key twice
    (dict(prefix_key=["a", "b"], prefix_tokens=[20, 10]), ValueError),    # lengths grow level by level
    (dict(prefix_key=["a", "b"], prefix_tokens=[0, 10]), ValueError),
    (dict(prefix_key=list("abcde"), prefix_tokens=[1, 2, 3, 4, 5]), ValueError),  # at most 4 levels
    (dict(prefix_key="a", prefix_tokens=[10]), TypeError),                # one value and a list
    (dict(prefix_key=["a"], prefix_tokens=10), TypeError),
    (dict(prefix_key=[1], prefix_tokens=[10]), TypeError),
])
def test_sharing_arguments_are_checked_before_redis(driver, kw, err):
    g = driver.gate(clock=Clock())
    with pytest.raises(err, match="prefix_"):
        driver(g.acquire("s", prompt_tokens=100, max_new_tokens=10, **kw))
    with pytest.raises(err, match="prefix_"):
        driver(g.acquire("s", prompt_ids=list(range(100)), max_new_tokens=10, **kw))
    assert driver(driver.client().keys("*")) == []  # nothing touched Redis


def test_both_gates_pass_the_sharing_to_the_ledger(driver):
    g = driver.gate(clock=Clock())
    driver(g.write_snapshot(engines(cap=10_000)))
    leases = [driver(g.acquire(s, prompt_ids=list(range(1000)), max_new_tokens=100, **TASK)) for s in ("a", "b")]
    assert [lease.reason for lease in leases] == ["open", "open"]
    st = driver(g.status())
    assert (st["reserved"], st["reserved_unshared"], st["prefixes"]) == (1400, 2200, 1)
    for s in ("a", "b"):
        driver(g.finish_session(s))
    assert driver(g.status())["reserved"] == 0
