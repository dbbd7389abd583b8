"""kvgate across a Redis failover (docs/deploy.md#failover).

A primary, a replica (``--replicaof``) and three sentinels, all real redis-server processes
started here and stopped by pid. Gates reach Redis through a ``redis+sentinel://`` URL
(parsed by kvgate._urls; redis-py has no URL form for Sentinel). Turns run from many threads
with waiters, leases and ownership windows live while the primary is killed with SIGKILL;
then, without help, turns bypass as ``degraded`` for a while, gating resumes on the promoted
replica, and once every turn has ended the ledger is exactly the live charges: nothing leaked,
nothing negative, no ticket admitted twice.

A failover loses the writes the replica had not received (Redis replicates asynchronously).
The managed-style test makes that loss certain: the replica is promoted (``REPLICAOF NO
ONE``) while the turns still write to the old primary, then the old primary is killed and the
clients' endpoint repointed. Without the client's replay of recently confirmed releases
(kvgate.client.flows.REPLAY_S) the releases written in between stay charged on the new primary
until ``lease_ttl_s``. Two focused tests make the failover by hand (a copy of the state taken
before the last writes, restored on a second server that the clients' endpoint then names):
a release lost is sent again, and a release drops the waiter record the copy kept of its turn
(else it holds up the FIFO until its liveness runs out).

The URL checks at the top need no server.
"""
from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass, field

import pytest
import redis

import kvgate
from kvgate._urls import parse_sentinel_url

from _deployflow import core_flow
from _gatehelpers import config, engines
from conftest import RedisProc, start_redis

REAL = [pytest.mark.redis_real, pytest.mark.slow]

SERVICE = "kvgate"

#: a sentinel's config: quick to call the primary down and to fail over (the test's runtime),
#: quorum 2 of 3. The sentinel rewrites the file, so conftest gives each its own copy.
SENTINEL_CONF = f"""sentinel monitor {SERVICE} 127.0.0.1 {{port}} 2
sentinel down-after-milliseconds {SERVICE} 800
sentinel failover-timeout {SERVICE} 3000
sentinel parallel-syncs {SERVICE} 1
"""

#: the liveness bound on a failover: sentinels agree, promote, and the clients find the new
#: primary well within it (a hang fails the test; not a latency claim)
FAILOVER_BOUND_S = 60.0

#: each turn reserves 200 of a 1000-token engine (ceiling 900 at headroom 0.9): four run,
#: the rest of the threads wait in the FIFO
TURN = dict(prompt_tokens=150, max_new_tokens=50)
CAPACITY = 1000
WORKERS = 8


# -- the URL: parsed by kvgate, refused before any connection --------------------------------
def test_a_sentinel_url_names_the_sentinels_the_service_and_the_database():
    u = parse_sentinel_url("redis+sentinel://kvgate:s%40cret@h1:26380,h2/mymaster?db=2&sentinel_password=sp")
    assert u.sentinels == (("h1", 26380), ("h2", 26379))  # Sentinel's default port
    assert u.service == "mymaster"
    assert u.master_kwargs == {"username": "kvgate", "password": "s@cret", "db": 2}
    assert u.sentinel_kwargs == {"password": "sp"}
    tls = parse_sentinel_url("rediss+sentinel://[::1]:5000/m?ssl_ca_certs=/etc/ca.crt")
    assert tls.sentinels == (("::1", 5000),)
    assert tls.master_kwargs == {"ssl_ca_certs": "/etc/ca.crt", "ssl": True}


@pytest.mark.parametrize("url, says", [
    ("redis+sentinel://h1:26379", "service"),
    ("redis+sentinel://h1:26379/", "service"),
    ("redis+sentinel://h1,,h2/m", "empty sentinel address"),
    ("redis+sentinel://h1:99999/m", "bad port"),
    ("redis+sentinel://h1/m?dbb=0", "unknown query key 'dbb'"),
    ("redis+sentinel://h1/m?db=one", "database number"),
    ("redis+sentinel://h1/m?ssl_ca_certs=/ca", "rediss\\+sentinel"),
    ("redis+sentinel://h1/m extra", "whitespace"),
])
def test_a_bad_sentinel_url_is_refused_before_any_connection(url, says):
    # every way kvgate builds a client refuses it at construction (no sentinel is asked;
    # h1 does not resolve here)
    for build in (lambda: kvgate.Gate.from_url(url, gate="g"), lambda: kvgate.AsyncGate.from_url(url, gate="g")):
        with pytest.raises(ValueError, match=says):
            build()


def test_a_password_is_not_repeated_in_the_error():
    with pytest.raises(ValueError) as e:
        kvgate.Gate.from_url("redis+sentinel://u:hunter2@h1/m?nope=1", gate="g")
    assert "hunter2" not in str(e.value) and "u:***@h1" in str(e.value)


def test_the_cli_says_a_bad_sentinel_url_is_a_usage_error(capsys):
    from kvgate.cli import main
    with pytest.raises(SystemExit) as ei:
        main(["status", "--redis", "redis+sentinel://h1:26379/", "--gate", "g"])
    assert ei.value.code == 2 and "service" in capsys.readouterr().err


def test_a_sentinel_url_with_cluster_is_refused():
    with pytest.raises(ValueError, match="cluster"):
        kvgate.Gate.from_url("redis+sentinel://h1/m", gate="g", cluster=True)


# -- a failover made by hand: what tells a client its releases may be lost -----------------
@pytest.fixture
def two_servers(tmp_path):
    """Two redis-servers, and an endpoint (a symlink, as a managed service's DNS name) that
    names the first; ``fail_over`` then moves the clients to the second."""
    a = start_redis(None, "--unixsocket", str(tmp_path / "a.sock"))
    try:
        b = start_redis(None, "--unixsocket", str(tmp_path / "b.sock"))
    except BaseException:
        a.stop(signal.SIGKILL)
        raise
    os.symlink(tmp_path / "a.sock", tmp_path / "redis.sock")
    yield a, b, f"unix://{tmp_path / 'redis.sock'}?db=0"
    a.stop(signal.SIGKILL)
    b.stop(signal.SIGKILL)


def fail_over(tmp_path, a: RedisProc, b: RedisProc, copy: dict) -> None:
    """B gets ``copy`` (the state as a lagging replica held it), A dies, the endpoint names B."""
    cb = b.client()
    for k, v in copy.items():
        cb.restore(k, 0, v, replace=True)
    cb.close()
    a.stop(signal.SIGKILL)
    link = tmp_path / "redis.sock.new"
    os.symlink(tmp_path / "b.sock", link)
    os.replace(link, tmp_path / "redis.sock")


def admitted(gate: kvgate.Gate, session: str):
    """A small turn admitted by the gate's Redis (the first may degrade while the client
    finds its connection dead; bounded)."""
    def turn():
        lease = gate.acquire(session, prompt_tokens=5, max_new_tokens=5, retain_session=False)
        if lease.outcome != "admit":
            lease.release()
            return None
        return lease
    return wait_until(turn, f"an admission of {session!r} on the new server", every_s=0.3)


@pytest.mark.redis_real
def test_a_release_the_new_server_lacks_is_sent_again(two_servers, tmp_path):
    a, b, url = two_servers
    g = kvgate.Gate.from_url(url, gate="lost", config=config())
    try:
        g.write_snapshot(engines())
        lease = g.acquire("s", prompt_tokens=100, max_new_tokens=10, retain_session=False)
        copy = {k: g.redis.dump(k) for k in g.redis.keys(g.key("*"))}  # before the release
        assert lease.release() is True
        fail_over(tmp_path, a, b, copy)
        cb = b.client()
        assert int(cb.hget(g.key("ledger"), "reserved")) == 110  # the release is lost
        # the next turn's reply names another server: the release goes again before the next call
        admitted(g, "t").release()
        assert int(cb.hget(g.key("ledger"), "reserved")) == 0
        assert cb.hlen(g.key("leases")) == 0 and g.deferred_count == 0
    finally:
        g.close()


@pytest.mark.redis_real
def test_a_waiter_the_new_server_kept_is_dropped_by_its_release(two_servers, tmp_path):
    # two processes: A's holds A; B's waited behind it. The copy has B still waiting; the old
    # server then granted B (at A's release), B ran and was released. On the copy B's waiter
    # would stay at the FIFO head (its process never asks again) until its liveness runs out,
    # holding up every turn behind it and then taking a grant nobody claims; B's release,
    # sent again, drops it
    from _gatehelpers import in_thread, result_within
    from _deployflow import wait_for_waiters
    a_srv, b_srv, url = two_servers
    # a re-check every 3 s, so B's stale waiter record would live 7 s (2 polls + 1 s)
    cfg = config(wait_poll_s=3.0, max_wait_s=5.0, max_wait_hard_s=60.0, staleness_s=60.0)  # no snapshot rewrite here
    ga = kvgate.Gate.from_url(url, gate="lost2", config=cfg)
    gb = kvgate.Gate.from_url(url, gate="lost2", config=cfg)
    try:
        ga.write_snapshot(engines(cap=CAPACITY))  # ceiling 900
        big = dict(prompt_tokens=500, max_new_tokens=100, retain_session=False)
        a = ga.acquire("a", **big)
        waiting = in_thread(gb.acquire, "b", **big)
        wait_for_waiters(ga, 1)
        copy = {k: ga.redis.dump(k) for k in ga.redis.keys(ga.key("*"))}
        a.release()
        b = result_within(waiting, 10, "B's grant")
        assert b.outcome == "admit"
        b.release()
        fail_over(tmp_path, a_srv, b_srv, copy)
        # C fits beside A (600 + 10), but queues behind B's stale waiter until B's release,
        # sent again before C's re-check, drops it
        admitted(gb, "c").release()
        # A's process runs a turn: its reply names the new server, so A's release goes again
        admitted(ga, "d").release()
        st = ga.status()
        assert (st["reserved"], st["leases"], st["waiting"]) == (0, 0, 0), st
        # B's waiter left with B's release, not by running out of liveness (a dead waiter)
        assert ga.redis.hget(ga.key("totals"), "dead_waiter") is None
    finally:
        ga.close()
        gb.close()


@pytest.mark.redis_real
@pytest.mark.parametrize("used_again", [False, True])
def test_a_finish_the_new_server_lacks_is_sent_again(two_servers, tmp_path, used_again):
    # the session's window (still charged, idle) survives on a copy made before its finish:
    # the finish, sent again at the first reply from the new server, ends it there. Unless
    # the session id was used again since: the earlier finish would end the new turn's window
    a, b, url = two_servers
    g = kvgate.Gate.from_url(url, gate="lostfin", config=config(idle_grace_s=600.0))
    try:
        g.write_snapshot(engines())  # with admission on, a turn opens its session's window
        assert g.acquire("s", prompt_tokens=100, max_new_tokens=10).release() is True
        copy = {k: g.redis.dump(k) for k in g.redis.keys(g.key("*"))}  # before the finish
        out = g.finish_session("s")
        assert (out["window"], out["freed"]) == (1, 110) and "srv" not in out
        again = None
        if used_again:  # the copy has the new turn's lease and window (the finish is in the past)
            again = g.acquire("s", prompt_tokens=100, max_new_tokens=10)
            copy = {k: g.redis.dump(k) for k in g.redis.keys(g.key("*"))}
        fail_over(tmp_path, a, b, copy)
        cb = b.client()
        admitted(g, "t").release()
        if again is not None:
            assert again.release() is True
        # the window the new server has: the one of the session's new life, or none
        assert cb.hexists(g.key("windows"), "s") is used_again
        assert int(cb.hget(g.key("ledger"), "reserved")) == (110 if used_again else 0)
        assert g.deferred_count == 0
        # counted once: by the new server that lacked it, or in the copy that has it
        assert int(cb.hget(g.key("totals"), "session_finished")) == 1
    finally:
        g.close()


# -- the servers ---------------------------------------------------------------------------
def role(rp: RedisProc) -> str:
    c = rp.client(socket_timeout=2)
    try:
        return c.info("replication")["role"]
    finally:
        c.close()


def wait_until(pred, what: str, bound_s: float = 20.0, every_s: float = 0.1):
    """Poll ``pred`` until it answers truthy (its answer), failing after ``bound_s``."""
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        try:
            v = pred()
        except (redis.RedisError, OSError):
            v = None
        if v:
            return v
        time.sleep(every_s)
    pytest.fail(f"{what} did not happen within {bound_s}s")


def start_primary(*extra: str) -> RedisProc:
    """A primary that starts a replica's first sync at once (Redis waits 5 s by default for
    more replicas to share a diskless sync)."""
    return start_redis(None, "--repl-diskless-sync-delay", "0", *extra)


def start_replica(primary: RedisProc, *extra: str) -> RedisProc:
    """A replica of ``primary``, once its first sync is done (it holds what the primary had)."""
    rp = start_redis(None, "--replicaof", "127.0.0.1", str(primary.port), *extra)
    wait_until(lambda: rp.client(socket_timeout=2).info("replication").get("master_link_status") == "up",
               "the replica's first sync")
    return rp


@dataclass
class Group:
    primary: RedisProc
    replica: RedisProc
    sentinels: list[RedisProc] = field(default_factory=list)

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://{hosts}/{SERVICE}?db=0"

    def master_port(self, s: RedisProc) -> int:
        c = s.client(socket_timeout=2)
        try:
            return int(c.sentinel_get_master_addr_by_name(SERVICE)[1])
        finally:
            c.close()


@pytest.fixture
def sentinel_group():
    procs: list[RedisProc] = []
    try:
        primary = start_primary()
        procs.append(primary)
        replica = start_replica(primary)
        procs.append(replica)
        g = Group(primary, replica)
        for _ in range(3):
            s = start_redis(None, "--sentinel", config=SENTINEL_CONF.format(port=primary.port))
            procs.append(s)
            g.sentinels.append(s)

        def ready(s: RedisProc) -> bool:
            # a failover needs the quorum: each sentinel must know the replica and the others
            m = s.client(socket_timeout=2, decode_responses=True).sentinel_master(SERVICE)
            return m["num-slaves"] == 1 and m["num-other-sentinels"] == 2
        for s in g.sentinels:
            wait_until(lambda: ready(s), "the sentinels finding the replica and each other", bound_s=30.0)
        yield g
    finally:
        for p in procs:
            p.stop(signal.SIGKILL)


# -- the turns -----------------------------------------------------------------------------
@dataclass
class Turns:
    """Threads that run turns on whatever gate ``gate`` is when each turn starts: acquire,
    hold briefly, release; every few turns the session ends (its window with it)."""

    gate: kvgate.Gate
    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    decisions: list = field(default_factory=list)  # (started, ended, ticket, outcome, reason)
    errors: list = field(default_factory=list)
    sessions: set = field(default_factory=set)
    threads: list = field(default_factory=list)

    def run(self, i: int) -> None:
        n = 0
        while not self.stop.is_set():
            sid = f"w{i}-s{n // 3}"  # three turns per session, so windows open, idle and end
            gate = self.gate
            try:
                started = time.monotonic()
                # before the acquire: an attempt the stop aborts may have been granted a lease
                # that opened the session's window, and its cancel leaves that window idle for
                # the idle grace, as a release does, so settle() must end this session too
                with self.lock:
                    self.sessions.add((gate, sid))
                # the stop aborts a wait, so the threads end without waiting out max_wait_s
                lease = gate.acquire(sid, abort_event=self.stop, **TURN)
                with self.lock:
                    self.decisions.append((started, time.monotonic(), lease.ticket, lease.outcome, lease.reason))
                time.sleep(0.02)
                lease.release()
                if n % 3 == 2:
                    gate.finish_session(sid)
            except kvgate.AdmissionCancelled:
                if not self.stop.is_set():
                    raise
            except Exception as e:  # noqa: BLE001 - the assertion: no turn raises
                with self.lock:
                    self.errors.append(repr(e))
            n += 1

    def start(self) -> None:
        for i in range(WORKERS):
            t = threading.Thread(target=self.run, args=(i,), daemon=True)
            t.start()
            self.threads.append(t)

    def join(self) -> None:
        self.stop.set()
        for t in self.threads:
            # a turn waits at most max_wait_s, a Redis call redis_timeout_s: far below this
            t.join(timeout=30)
            assert not t.is_alive(), "a turn thread hung"

    def admits_started_after(self, t: float) -> list:
        with self.lock:
            return [d for d in self.decisions if d[0] > t and d[3] == "admit"]


def cfg(**knobs) -> kvgate.GateConfig:
    # waits end by pub/sub or aging within the run; a snapshot stays fresh across the
    # failover gap (the writer below rewrites it on the new primary); Redis calls are bounded
    # by 0.5 s so a dead primary costs little per call
    return config(**{**dict(max_wait_s=5.0, max_wait_hard_s=10.0, wait_poll_s=0.2, staleness_s=20.0,
                            redis_timeout_s=0.5), **knobs})


class SnapshotWriter:
    """Writes the engines' snapshot every 0.3 s (the poller's job: it lives in Redis, so the
    new primary needs it too, and it has it only as far as it was replicated)."""

    def __init__(self, gate: kvgate.Gate):
        self.gate, self.stop = gate, threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                self.gate.write_snapshot(engines(cap=CAPACITY))
            except (redis.RedisError, OSError):
                pass  # the primary is gone: the next write goes to the one Sentinel names
            self.stop.wait(0.3)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=10)


def settle(gate: kvgate.Gate, ops: kvgate.Gate, turns: Turns) -> tuple[dict, int]:
    """After the run: every session ended, every deferred give-back sent. The status then,
    and how many releases and cancels the gate sent again for the new primary."""
    for sid in sorted({sid for _, sid in turns.sessions}):
        gate.finish_session(sid)  # through the gate that reaches the new primary
    replayed = 0

    def flushed() -> bool:
        nonlocal replayed
        # any script call sends what is deferred (once the breaker closes); the metrics
        # drain this process's counters, so they are summed here
        replayed += int(gate.step_metrics()["agentic_kv/client/replayed"])
        return gate.deferred_count == 0
    wait_until(flushed, "the deferred releases reaching Redis", every_s=0.3)
    ops.housekeep()
    return ops.status(), replayed


def assert_exact_ledger(ops: kvgate.Gate, st: dict) -> None:
    """The ledger holds exactly the live charges, and here there are none."""
    import json
    r = ops.redis
    leases = {k: json.loads(v) for k, v in r.hgetall(ops.key("leases")).items()}
    windows = {k: json.loads(v) for k, v in r.hgetall(ops.key("windows")).items()}
    assert st["reserved"] == sum(l["t"] for l in leases.values()) + sum(w["t"] for w in windows.values())
    assert (st["reserved"], st["leases"], st["waiting"], st["windows"]) == (0, 0, 0, 0), (st, leases, windows)
    assert all(l["t"] >= 0 for l in leases.values()) and st["reserved"] >= 0


def check_run(turns: Turns, killed_at: float) -> str:
    """No turn raised, none was admitted twice, turns bypassed as degraded only for a bounded
    stretch after the kill, and gating resumed after it (an admission that began after the
    last degraded turn). Returns what was measured, for the log: from the kill to the end of
    the degraded stretch, and to the first admission by the new primary."""
    assert not turns.errors, turns.errors[:5]
    tickets = [d[2] for d in turns.decisions if d[3] == "admit"]
    assert len(tickets) == len(set(tickets)), "a ticket admitted twice"
    bypasses = {d[4] for d in turns.decisions if d[3] == "bypass"}
    outcomes = {(d[3], d[4]) for d in turns.decisions}
    assert {o for o, _ in outcomes} <= {"admit", "bypass"}, f"a turn neither admitted nor bypassed: {outcomes}"
    assert bypasses <= {"degraded", "aged"}, bypasses  # aged: a long wait at the ceiling, by design
    degraded = [d for d in turns.decisions if d[4] == "degraded"]
    # a pooled connection may fail once per thread after the first admission on the new
    # primary, so the stretch is bounded, not ended by the first admission
    assert all(killed_at - 1.0 <= d[0] <= killed_at + FAILOVER_BOUND_S for d in degraded), \
        "degraded outside the failover"
    last = max((d[1] for d in degraded), default=killed_at)
    assert turns.admits_started_after(last), "gating did not resume after the degraded stretch"
    first = min(d[1] for d in turns.admits_started_after(killed_at))
    return (f"{len(degraded)} of {len(turns.decisions)} turns degraded, the last ending "
            f"{last - killed_at:.1f}s after SIGKILL; first admission after it at {first - killed_at:.1f}s")


@pytest.mark.redis_real
@pytest.mark.slow
def test_turns_survive_a_sentinel_failover(sentinel_group):
    g = sentinel_group
    gate = kvgate.Gate.from_url(g.url, gate="fo", config=cfg())
    ops = kvgate.Gate.from_url(g.url, gate="fo", config=cfg())
    writer = SnapshotWriter(ops)
    turns = Turns(gate)
    try:
        wait_until(lambda: ops.status()["ceiling"] > 0, "the first snapshot")
        turns.start()
        wait_until(lambda: ops.status()["waiting"] > 0 and len(turns.admits_started_after(0)) > 10,
                   "turns running with waiters queued")
        killed_at = time.monotonic()
        g.primary.stop(signal.SIGKILL)
        # gating resumes by itself: an admission decided after the kill (its acquire began
        # after it, so the old primary cannot have answered it) by the promoted replica
        wait_until(lambda: turns.admits_started_after(killed_at), "an admission after the failover",
                   bound_s=FAILOVER_BOUND_S, every_s=0.05)
        # the gate asked whichever sentinel answered first; the others learn the new primary
        # from its hello messages (one each 2 s), so they agree a little later, not at once
        wait_until(lambda: all(g.master_port(s) == g.replica.port for s in g.sentinels),
                   "every sentinel naming the promoted replica")
        assert role(g.replica) == "master"
        time.sleep(2.0)  # turns keep running on the new primary
        turns.join()
        print(f"\nsentinel failover: {check_run(turns, killed_at)}")
        st, replayed = settle(gate, ops, turns)
        print(f"{replayed} releases, cancels and finishes sent again to the new primary")
        assert_exact_ledger(ops, st)
    finally:
        turns.stop.set()
        writer.close()
        gate.close()
        ops.close()


@pytest.mark.redis_real
@pytest.mark.slow
def test_core_flow_through_sentinel(sentinel_group, driver):
    # a poller tick, both gates, status: everything a deployment sends, through the sentinels
    core_flow(driver, sentinel_group.url)


@pytest.mark.redis_real
@pytest.mark.slow
@pytest.mark.parametrize("repoint", ["endpoint", "new_gate"])
def test_managed_failover_that_loses_writes(tmp_path, repoint):
    # "endpoint": the clients reach Redis at one endpoint (a unix socket path, as a managed
    # service's DNS name) that is repointed to the promoted replica: the same URL, the same
    # gates. "new_gate": the process builds new gates on the replica's own URL; the old gates
    # cannot send again what they saw confirmed, so their lost releases wait for lease_ttl_s
    # (short here, so the ledger is seen to drain to exactly the live charges)
    endpoint = tmp_path / "redis.sock"
    primary = start_primary("--unixsocket", str(tmp_path / "primary.sock"))
    procs = [primary]
    knobs = {} if repoint == "endpoint" else {"lease_ttl_s": 3.0}
    try:
        replica = start_replica(primary, "--unixsocket", str(tmp_path / "replica.sock"))
        procs.append(replica)
        os.symlink(tmp_path / "primary.sock", endpoint)
        url = f"unix://{endpoint}?db=0"
        gates = [kvgate.Gate.from_url(url, gate="mf", config=cfg(**knobs))]
        ops = [kvgate.Gate.from_url(url, gate="mf", config=cfg(**knobs))]
        writers = [SnapshotWriter(ops[0])]
        turns = Turns(gates[0])
        try:
            wait_until(lambda: ops[0].status()["ceiling"] > 0, "the first snapshot")
            turns.start()
            wait_until(lambda: ops[0].status()["waiting"] > 0 and len(turns.admits_started_after(0)) > 10,
                       "turns running with waiters queued")
            # promote the replica while the turns still write to the old primary: what they
            # write from here on (releases, grants, windows) is acknowledged and lost
            replica.client().replicaof("NO", "ONE")
            promoted_at = time.monotonic()
            wait_until(lambda: len(turns.admits_started_after(promoted_at)) > 10, "turns on the old primary")
            with turns.lock:
                lost = sum(d[0] > promoted_at for d in turns.decisions)
            killed_at = time.monotonic()
            primary.stop(signal.SIGKILL)
            if repoint == "endpoint":
                os.replace(_new_link(tmp_path, replica), endpoint)  # the endpoint now names the replica
            else:
                new_url = f"unix://{tmp_path / 'replica.sock'}?db=0"
                gates.append(kvgate.Gate.from_url(new_url, gate="mf", config=cfg(**knobs)))
                ops.append(kvgate.Gate.from_url(new_url, gate="mf", config=cfg(**knobs)))
                writers[0].close()
                writers.append(SnapshotWriter(ops[-1]))
                turns.gate = gates[-1]  # turns from now on; those running end on the old gate
            wait_until(lambda: turns.admits_started_after(killed_at), "an admission after the failover",
                       bound_s=FAILOVER_BOUND_S, every_s=0.05)
            time.sleep(2.0)  # turns keep running on the new primary
            turns.join()
            print(f"\nmanaged failover ({repoint}): {lost} turns decided by the old primary after the "
                  f"promotion (their writes lost); {check_run(turns, killed_at)}")
            st, replayed = settle(gates[-1], ops[-1], turns)
            print(f"{replayed} releases, cancels and finishes sent again to the new primary")
            if repoint == "new_gate":
                def drained() -> dict | None:
                    ops[-1].housekeep()  # the poller's reclaim of expired leases
                    s = ops[-1].status()
                    return s if s["leases"] == 0 else None
                st = wait_until(drained, "the old gates' lost releases expiring (lease_ttl_s)", bound_s=30.0)
            assert_exact_ledger(ops[-1], st)
        finally:
            turns.stop.set()
            for w in writers:
                w.close()
            for g in gates + ops:
                g.close()
    finally:
        for p in procs:
            p.stop(signal.SIGKILL)


def _new_link(tmp_path, replica: RedisProc):
    """A symlink to the replica's socket beside the endpoint, to rename over it atomically."""
    link = tmp_path / "redis.sock.new"
    os.symlink(tmp_path / "replica.sock", link)
    return link
