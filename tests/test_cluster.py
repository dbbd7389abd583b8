"""Redis Cluster: a gate lives in one hash slot, so every script runs on a 3-node cluster.

Runs against the 3-master ``redis_cluster`` fixture with redis-py's ``RedisCluster``:
- every key a script receives (``kvgate.keys.script_keys``) and the event channel map to
  one slot, by the server's ``CLUSTER KEYSLOT`` and by the client's own hashing;
- every script (acquire / release / cancel / finish_session / housekeep / write_snapshot /
  bump_epoch / drain_stats) runs through ``kvgate.Gate(RedisCluster(...))``, including a
  turn that waits in the FIFO and is granted by another turn's release;
- two gates whose slots live on different nodes both work, independently;
- a node that lost the function library (FUNCTION FLUSH) gets it again from the next call;
- a gate from a cluster URL, sync or asyncio (``redis.asyncio.cluster.RedisCluster``),
  does all of that too, and reports its status (one test body, the ``driver`` fixture).
"""
from __future__ import annotations

import concurrent.futures
import json

import pytest
import redis
from redis.cluster import RedisCluster

import kvgate
from kvgate import keys as kvkeys

from _gatehelpers import Driver

pytestmark = [pytest.mark.cluster, pytest.mark.redis_real]

CAP = 1000

#: the sync driver, for the tests on the sync gate alone
SYNC = Driver("sync")


def _cfg(**kw) -> kvgate.GateConfig:
    base = dict(redis_timeout_s=2.0, wait_poll_s=0.2, max_wait_s=20.0, staleness_s=60.0, idle_grace_s=0.0)
    base.update(kw)
    return kvgate.GateConfig(**base)


def _engines(usage: float = 0.1):
    return [kvgate.EngineState("http://127.0.0.1:9501", capacity_tokens=CAP, usage=usage,
                               url="http://127.0.0.1:9501")]


@pytest.fixture
def cluster_client(redis_cluster):
    rc = RedisCluster(host="127.0.0.1", port=redis_cluster[0].port, socket_timeout=5, decode_responses=True)
    yield rc
    rc.close()


def _server_slot(node_client: redis.Redis, key: str) -> int:
    return int(node_client.execute_command("CLUSTER", "KEYSLOT", key))


@pytest.mark.parametrize("name", ["qwen-32b-train", "a", "eval:v2", "x.y_z-1"])
def test_all_keys_of_a_gate_share_one_slot(redis_cluster, cluster_client, name):
    node = redis_cluster[0].client()
    ks = kvkeys.script_keys(name) + [kvkeys.channel(name)]
    assert len(ks) == len(kvkeys.SCRIPT_KEYS) + 1
    slots = {_server_slot(node, k) for k in ks}
    assert len(slots) == 1, dict(zip(ks, (_server_slot(node, k) for k in ks)))
    assert {cluster_client.keyslot(k) for k in ks} == slots
    # the slot is the hash tag's
    assert slots == {_server_slot(node, "{%s}" % name)}


def _gate_state(rc: RedisCluster, g: kvgate.Gate) -> dict:
    return {"reserved": int(rc.hget(g.key("ledger"), "reserved") or 0),
            "leases": rc.hlen(g.key("leases")), "fifo": rc.zcard(g.key("fifo")),
            "waiters": rc.hlen(g.key("waiters")), "windows": rc.hlen(g.key("windows"))}


def _exercise(rc: RedisCluster, g, driver: Driver) -> None:
    """Run every script through the gate (of the driver's kind) on the cluster and check what
    each did."""
    snap = driver(g.write_snapshot(_engines()))                             # write_snapshot
    assert snap.capacity_tokens == CAP and snap.n_healthy == 1
    a = driver.call(g.acquire, "a", prompt_tokens=800, max_new_tokens=0)   # acquire: open
    assert (a.outcome, a.reason) == ("admit", "open")
    # a turn that does not fit waits; the release grants it (advance + pub/sub or poll)
    fut = driver.start(g.acquire, "b", prompt_tokens=500, max_new_tokens=0)
    for _ in range(500):
        if rc.zcard(g.key("fifo")) == 1:
            break
        concurrent.futures.wait([fut], timeout=0.01)
    assert rc.zcard(g.key("fifo")) == 1
    assert driver(a.release()) is True                                      # release
    b = fut.result(timeout=30)
    assert (b.outcome, b.reason) == ("admit", "open") and b.waited_s > 0
    # a caller timeout cancels its waiter                                    # cancel
    with pytest.raises(kvgate.AdmissionTimeout):
        driver(g.acquire("c", prompt_tokens=500, max_new_tokens=0, timeout_s=0.3))
    assert _gate_state(rc, g)["fifo"] == 0
    assert driver(b.release()) is True
    out = driver(g.finish_session("b"))                                     # finish_session
    assert "error" not in out
    hk = driver(g.housekeep(10))                                            # housekeep
    assert (hk["leases"], hk["windows"], hk["waiters"], hk["granted"]) == (0, 0, 0, 0), hk
    ep = driver(g.bump_epoch())                                             # bump_epoch
    assert ep == 1
    m = driver(g.step_metrics())                                            # drain_stats
    assert m["agentic_kv/admission/admit"] == 2 and m["agentic_kv/budget/epoch"] == 1
    assert m["agentic_kv/budget/degraded"] == 0.0
    assert driver(g.engine_urls()) == ["http://127.0.0.1:9501"]
    driver(g.record_close(2, 1))
    assert _gate_state(rc, g) == {"reserved": 0, "leases": 0, "fifo": 0, "waiters": 0, "windows": 0}
    totals = rc.hgetall(g.key("totals"))
    assert totals.get("ledger_clamped") is None and totals["close"] == "2"


def test_every_script_runs_on_the_cluster(cluster_client):
    g = kvgate.Gate(cluster_client, gate="cl-every", config=_cfg())
    try:
        _exercise(cluster_client, g, SYNC)
    finally:
        g._listener.close()


def test_gate_from_url_on_the_cluster(redis_cluster, cluster_client, driver):
    g = driver.from_url(f"redis://127.0.0.1:{redis_cluster[1].port}/0", gate=f"cl-url-{driver.kind}",
                        config=_cfg(), cluster=True)
    try:
        _exercise(cluster_client, g, driver)
        assert int(cluster_client.hget(g.key("ledger"), "reserved")) == 0
    finally:
        driver.close(g)


def test_two_gates_on_different_nodes_both_work(cluster_client):
    def node_of(name: str) -> int:
        return cluster_client.get_node_from_key(kvkeys.key(name, "ledger")).port

    names = [f"gate-{i}" for i in range(64)]
    first = names[0]
    second = next(n for n in names[1:] if node_of(n) != node_of(first))
    assert cluster_client.keyslot(kvkeys.key(first, "ledger")) != cluster_client.keyslot(kvkeys.key(second, "ledger"))
    g1 = kvgate.Gate(cluster_client, gate=first, config=_cfg())
    g2 = kvgate.Gate(cluster_client, gate=second, config=_cfg())
    try:
        _exercise(cluster_client, g1, SYNC)
        _exercise(cluster_client, g2, SYNC)
        # independent ledgers: a lease on one gate is invisible to the other
        l1 = g1.acquire("s", prompt_tokens=800, max_new_tokens=0)
        l2 = g2.acquire("s", prompt_tokens=800, max_new_tokens=0)
        assert (l1.outcome, l1.reason) == (l2.outcome, l2.reason) == ("admit", "open")
        assert _gate_state(cluster_client, g1)["reserved"] == _gate_state(cluster_client, g2)["reserved"] == 800
        assert l1.release() and l2.release()
        # each gate's keys live on its own node
        for g in (g1, g2):
            port = node_of(g.name)
            node = redis.Redis(host="127.0.0.1", port=port, decode_responses=True)
            try:
                assert node.exists(g.key("ledger")) == 1
                assert json.loads(node.hget(g.key("snapshot"), "engines"))[0]["cap"] == CAP
            finally:
                node.close()
    finally:
        g1._listener.close()
        g2._listener.close()


def test_a_node_that_lost_the_function_library_gets_it_again(redis_cluster, driver):
    # FUNCTION FLUSH on the gate's node alone (as a node added or restarted empty): the load
    # goes to every primary, including those that still have it, and the call then runs
    g = driver.from_url(f"redis://127.0.0.1:{redis_cluster[0].port}/0", gate=f"cl-lib-{driver.kind}",
                        config=_cfg(), cluster=True)
    admin = RedisCluster(host="127.0.0.1", port=redis_cluster[0].port, socket_timeout=5)
    try:
        driver(g.write_snapshot(_engines()))
        node = admin.get_node_from_key(kvkeys.key(g.name, "ledger"))
        admin.get_redis_connection(node).function_flush()
        lease = driver.call(g.acquire, "a", prompt_tokens=300, max_new_tokens=0)
        assert (lease.outcome, lease.reason) == ("admit", "open")
        assert driver(lease.release()) is True
        assert g._caller.use_functions
        for n in admin.get_primaries():
            names = [dict(zip(lib[::2], lib[1::2]))[b"library_name"]
                     for lib in admin.get_redis_connection(n).function_list()]
            assert g._caller.library.split("\n", 1)[0].split("=")[1].encode() in names
    finally:
        admin.close()
        driver.close(g)


def test_status_on_the_cluster(redis_cluster, driver):
    g = driver.from_url(f"redis://127.0.0.1:{redis_cluster[0].port}/0", gate=f"cl-status-{driver.kind}",
                        config=_cfg(), cluster=True)
    try:
        driver(g.write_snapshot(_engines()))
        st = driver(g.status())
        assert st["reserved"] == 0 and not st["degraded"]
        lease = driver(g.acquire("a", prompt_tokens=300, max_new_tokens=0))
        st = driver(g.status())
        assert st["reserved"] == 300 and st["leases"] == 1 and not st["degraded"]
        driver(lease.release())
    finally:
        driver.close(g)
