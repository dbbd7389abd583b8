"""A Hypothesis stateful model of the gate's ledger, FIFO, leases and windows, run against
a real redis-server with an injected script clock (SPEC section 8).

Every step is one atomic script call (acquire of a new ticket, re-check of a waiting one,
call-back after a probe, re-check of a held one; release; cancel; finish_session;
housekeep; write_snapshot with random capacities, usage and healthy sets; bump_epoch;
drain_stats) or a clock advance (polls, past grace / liveness / claim / TTL, rarely past
staleness); the blocking turn flow is not involved, so each step is exactly one state
transition. Before and after every step the whole gate state is read back from Redis and
checked:

- the ledger equals the own charges of live leases plus the charges of windows plus each
  shared prefix once (its record, while any holder of it is charged), never goes negative,
  and ``ledger_clamped`` is never counted; a prefix's holder count is the leases and windows
  that hold it, a holder's own charge and shared part add up to its need, and the ledger's
  ``psaved`` is what sharing saves (the holders' shared parts less the records' charges);
- every grant is counted once (the ``admit`` counter moves by exactly the number of new
  leases), a ticket is never granted while it holds a lease, and a ticket the client saw
  admitted is only ever answered with that same lease (rule 4);
- FIFO: a ticket granted ``open`` never leaves a waiter with a smaller sequence behind; a
  new attempt enters at the back, or at the place of the attempt it supersedes (only
  while its successor is undecided);
- aging (SPEC 8): the FIFO head is never told to keep waiting once it waited
  max_wait_hard_s, or once the gate made no progress for max_wait_s (progress as the model
  sees it: a lease granted other than by aging, a lease gone, a window ended); and no turn
  is admitted ``aged`` before that;
- waiters / fifo / alive / session_waiter agree with each other, at most one waiting
  attempt per session;
- leases and lease_exp hold the same tickets; idle windows are exactly those in
  window_exp; a window's holder count equals the live leases held under it since it
  opened (leases of an ended window must not touch a newer window of the session).

A few outcomes are also predicted from the state before the step (rule 4, preempted,
protected, degraded, and the exact returns of release / cancel / finish_session /
write_snapshot / bump_epoch / drain_stats); the rule-by-rule decision table itself is
tested in tests/test_gate_rules.py. Fixed sequences that once broke an invariant
(BUG-INV-1, -3, -4 in the history) are kept as directed tests at the end.

Knobs: ``KVGATE_STATEFUL_EXAMPLES`` (default 150, about 20 s), ``KVGATE_STATEFUL_STEPS``
(default 40), ``KVGATE_STATEFUL_NO_SHRINK=1``
(long bug hunts), ``KVGATE_STATEFUL_DB=<dir>`` (keep failing examples for replay). Hypothesis
prints the failing step sequence and a ``@reproduce_failure`` blob.
"""
from __future__ import annotations

import json
import math
import os
import uuid
from collections import Counter

import pytest
import redis
from hypothesis import HealthCheck, Phase, event, settings
from hypothesis.database import DirectoryBasedExampleDatabase
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition, rule,
                                 run_state_machine_as_test)

import kvgate
from kvgate import keys as kvkeys
from kvgate.client.flows import snapshot_params

pytestmark = pytest.mark.redis_real

SESSIONS = [f"s{i}" for i in range(4)]
ENGINE_IDS = ["http://127.0.0.1:9101", "http://127.0.0.1:9102", "http://127.0.0.1:9103"]
T0 = 1_700_000_000_000
OUTCOMES: Counter = Counter()   # what the runs reached (printed with -s)


def _j(raw):
    return json.loads(raw) if raw is not None else None


class GateState:
    """Everything a gate holds in Redis, decoded, at one moment."""

    def __init__(self, r: redis.Redis, gate: kvgate.Gate):
        k = gate.key
        p = r.pipeline(transaction=False)
        p.hgetall(k("ledger"))
        p.hgetall(k("leases"))
        p.zrange(k("lease_exp"), 0, -1, withscores=True)
        p.hgetall(k("windows"))
        p.zrange(k("window_exp"), 0, -1, withscores=True)
        p.hgetall(k("waiters"))
        p.zrange(k("fifo"), 0, -1, withscores=True)
        p.zrange(k("alive"), 0, -1, withscores=True)
        p.hgetall(k("session_waiter"))
        p.hgetall(k("totals"))
        p.hgetall(k("snapshot"))
        p.hgetall(k("prefixes"))
        has_order = "window_order" in kvkeys.SCRIPT_KEYS
        if has_order:
            p.zrange(k("window_order"), 0, -1, withscores=True)
        res = p.execute()
        (ledger, leases, lease_exp, windows, window_exp, waiters, fifo, alive, sw, totals,
         snap, prefixes) = res[:12]
        self.window_order = dict(res[12]) if has_order else None
        self.prefixes = {k: json.loads(v) for k, v in prefixes.items()}
        self.ledger = ledger
        self.reserved = int(ledger.get("reserved", 0))
        self.seq = int(ledger.get("seq", 0))
        self.epoch = int(ledger.get("epoch", 0))
        self.leases = {t: json.loads(v) for t, v in leases.items()}
        self.lease_exp = dict(lease_exp)
        self.windows = {s: json.loads(v) for s, v in windows.items()}
        self.window_exp = dict(window_exp)
        self.waiters = {t: json.loads(v) for t, v in waiters.items()}
        self.fifo = dict(fifo)
        self.alive = dict(alive)
        self.sw = sw
        self.totals = {f: float(v) for f, v in totals.items()}
        self.snap = snap

    def total(self, field: str) -> int:
        return int(self.totals.get(field, 0))

    def fresh(self, now: int, stale_ms: int) -> bool:
        ts = self.snap.get("ts_ms")
        return (ts is not None and int(self.snap.get("n_healthy", 0)) > 0
                and now - int(ts) <= stale_ms)

    def scale(self, now: int, stale_ms: int, fixed: float | None) -> float:
        """The budget scale the scripts use (docs/budget.md): the fixed knob, else the measured
        one while fresh, else 1."""
        if fixed is not None:
            return fixed
        ts = self.snap.get("budget_ts_ms")
        if ts is not None and now - int(ts) <= stale_ms and float(self.snap.get("budget_scale", 0)) > 0:
            return float(self.snap["budget_scale"])
        return 1.0


class GateMachine(RuleBasedStateMachine):
    URL: str = ""

    def __init__(self):
        super().__init__()
        self.r = redis.Redis.from_url(self.URL, decode_responses=True, socket_timeout=5)
        self.now = T0
        self.gate: kvgate.Gate | None = None
        self.tickets: dict[str, dict] = {}     # ticket -> session, need, retain, protected
        self.waiting: set[str] = set()          # last answer "wait": the flow re-checks these
        self.probing: set[str] = set()          # last answer "probe": the flow probes, then re-checks
        self.held: set[str] = set()             # the client saw "admit" and has not released
        self.seen_admit: dict[str, dict] = {}   # ticket -> the lease the client was admitted with
        self.granted: dict[str, int] = {}       # ticket -> admitted ms of its (current) grant
        self.unclaimed_lost: set[str] = set()   # grants freed before their ticket claimed them
        self.win_gen = {s: 0 for s in SESSIONS}
        self.lease_gen: dict[str, int] = {}
        self.cancelled: set[str] = set()
        self.preempted_by: dict[str, str] = {}  # preempted attempt -> the attempt that superseded it
        self.in_hypothesis = True                # False when a test drives the model by hand
        self.state: GateState | None = None
        self.last_progress: int | None = None   # the model's own record of the gate's progress

    # -- setup / teardown ------------------------------------------------------------------
    @initialize(features=st.sampled_from([(True, True), (True, False), (False, True)]),
                grace=st.sampled_from([0.0, 2.0]), has_probe=st.booleans(),
                usage=st.sampled_from([None, 0.1, 0.86, 0.95]), cap=st.sampled_from([1000, 2000, 4000]),
                scale=st.sampled_from([None, None, 1.5]))
    def setup(self, features, grace, has_probe, usage=None, cap=2000, scale=None):
        adm, res = features
        self.cfg = kvgate.GateConfig(admission=adm, residency=res, idle_grace_s=grace, wait_poll_s=1.0,
                                     max_wait_s=2.0, max_wait_hard_s=6.0, lease_ttl_s=10.0, staleness_s=30.0,
                                     reap_batch=8, budget_scale=scale)
        self.has_probe = has_probe and res
        self.gate = kvgate.Gate(self.r, gate=f"st-{uuid.uuid4().hex[:10]}", config=self.cfg,
                                clock_ms=lambda: self.now)
        self.state = GateState(self.r, self.gate)
        if usage is not None:
            self.write_snapshot(healthy=[True, True, False], caps=[cap, cap, cap], usage=usage)

    def teardown(self):
        if self.state is not None:
            for f in ("window_revoked", "window_expired", "window_epoch_dropped", "lease_expired", "dead_waiter",
                      "wait_granted", "preempted", "cancelled", "group_admit", "prefix_charged"):
                OUTCOMES["totals " + f] += self.state.total(f)
        if self.gate is not None:
            self.r.delete(*self.gate._keys)
        self.r.close()

    # -- one atomic step -------------------------------------------------------------------
    def call(self, script: str, **params) -> dict:
        pre = self.state
        raw = self.gate._call_script(self.gate._flows.eval_op(script, params))
        out = json.loads(raw)
        post = GateState(self.r, self.gate)
        self.check_transition(pre, post, script, params)
        self.state = post
        return out

    def check_transition(self, pre: GateState, post: GateState, script: str, params: dict) -> None:
        # every grant counted once: the admit counter moves by the number of new leases
        new = [t for t, l in post.leases.items() if t not in pre.leases or pre.leases[t]["a"] != l["a"]]
        assert post.total("admit") - pre.total("admit") == len(new), (script, params, new)
        for t in new:
            # never granted while holding a lease; a second grant only after the first was
            # freed before its ticket ever claimed it (the client never saw that admit)
            assert t not in pre.leases, (f"ticket {t} granted again while it holds a lease: before "
                                         f"{pre.leases[t]} (expires {pre.lease_exp[t]}), after {post.leases[t]}, "
                                         f"now {self.now}, {script} {params}")
            assert t not in self.seen_admit, f"ticket {t} admitted twice (client saw admit before)"
            if t in self.granted:
                assert t in self.unclaimed_lost, f"ticket {t} granted twice"
            self.granted[t] = post.leases[t]["a"]
        for t, l in pre.leases.items():
            if t not in post.leases and l.get("c") == 1:
                self.unclaimed_lost.add(t)
        # a lease that stays keeps its grant (rule 4: same lease, charged once)
        for t, l in post.leases.items():
            if t in pre.leases and t not in new:
                assert l["t"] == pre.leases[t]["t"] and l["s"] == pre.leases[t]["s"], (t, pre.leases[t], l)
        self.check_fifo_order(pre, post, new, params if script == "acquire" else None)
        self.track_windows(pre, post, new)
        # the gate's progress (SPEC 4), derived from the state, not read from the scripts
        gone = [t for t in pre.leases if t not in post.leases or t in new]
        ended = [s_ for s_, w in pre.windows.items()
                 if s_ not in post.windows or post.windows[s_]["id"] != w["id"]]
        if gone or ended or any(post.leases[t]["r"] != "aged" for t in new):
            self.last_progress = self.now
        recorded = post.ledger.get("progress_ms")
        assert (int(recorded) if recorded is not None else None) == self.last_progress, (
            script, params, recorded, self.last_progress)

    def fair_place(self, pre: GateState, post: GateState, acq: dict) -> float | None:
        """The FIFO place (sequence) a new attempt may take: the place of the session's older
        attempt it supersedes (preempted in this very step, or by itself / by an attempt that
        is still between its "probe" answer and its call back), else None (a fresh place)."""
        t = acq["ticket"]
        old = pre.sw.get(acq["session"])
        ow = pre.waiters.get(old) if old else None
        # (the older attempt's record survives the step unless reaped as dead first)
        if ow is None or old == t or old not in post.waiters:
            return None
        if ow["st"] == "w" and old in pre.fifo:
            return pre.fifo[old]
        if ow["st"] == "p" and ow.get("q") is not None:
            # the place a preempted record still holds (its successor is probing, or gave up
            # while probing: cancelled or dead) goes to the session's newest attempt; any
            # decision of the successor consumes it (acquire.lua out())
            return ow["q"]
        return None

    def check_fifo_order(self, pre: GateState, post: GateState, new: list[str], acq: dict | None) -> None:
        place = None
        if acq is not None:
            t = acq["ticket"]
            old = pre.sw.get(acq["session"])
            if old and old != t and pre.waiters.get(old, {}).get("st") == "w" \
                    and post.waiters.get(old, {}).get("st") == "p":
                self.preempted_by[old] = t
            if t not in pre.fifo:
                place = self.fair_place(pre, post, acq)
                if t in post.fifo:
                    # a new attempt enters at its superseded attempt's place or at the back
                    why = (f"(session waiter before: {pre.sw.get(acq['session'])}, "
                           f"{pre.waiters.get(pre.sw.get(acq['session']) or '')}; FIFO before {pre.fifo})")
                    if place is not None:
                        assert post.fifo[t] == place, f"{t} entered at {post.fifo[t]}, not its place {place} {why}"
                    else:
                        assert post.seq == pre.seq + 1 and post.fifo[t] == post.seq, (
                            f"{t} entered the FIFO at {post.fifo[t]}, expected a fresh place at the back "
                            f"({pre.seq + 1}) {why}")
        for t in new:
            l = post.leases[t]
            if l["r"] != "open":
                continue  # rules 5 and 7 (and 8) jump the FIFO by design
            seq = pre.fifo.get(t)
            if seq is None and acq is not None and acq["ticket"] == t:
                # a new attempt: its fair place, or the back (it may enter at once when
                # nobody waits)
                seq = place if place is not None else post.seq
            assert seq is not None, f"open grant to {t}, which neither waited nor asked: {l}"
            behind = {w: s for w, s in post.fifo.items() if s <= seq}
            assert not behind, f"open grant to {t} (seq {seq}) jumped older waiters {behind}"

    def track_windows(self, pre: GateState, post: GateState, new: list[str]) -> None:
        for s in SESSIONS:
            a, b = pre.windows.get(s), post.windows.get(s)
            if a is not None and (b is None or b["ep"] != a["ep"]):
                self.win_gen[s] += 1  # that window ended (a newer one may have opened)
        for t in new:
            l = post.leases[t]
            if l["w"] == 1:
                self.lease_gen[t] = self.win_gen[l["s"]]

    # -- invariants on the state after every step -------------------------------------------
    @invariant()
    def ledger_matches_leases_and_windows(self):
        s = self.state
        if s is None:
            return
        own = sum(l["t"] for l in s.leases.values())
        win = sum(w["t"] for w in s.windows.values())
        shared = sum(p["t"] for p in s.prefixes.values())
        assert s.reserved >= 0
        assert s.reserved == own + win + shared, (s.reserved, own, win, shared, s.leases, s.windows, s.prefixes)
        assert all(l["t"] >= 0 for l in s.leases.values())
        assert all(w["t"] >= 0 for w in s.windows.values())
        assert s.total("ledger_clamped") == 0, "the ledger was clamped at zero (a double give-back)"

    @invariant()
    def shared_prefixes_charged_once(self):
        """Each shared prefix is charged once, by its record, exactly while something holds it;
        a holder (a lease with a charge of its own, or a window) is charged its need less its
        shared part, which is at most what the record charges."""
        s = self.state
        if s is None:
            return
        holders: dict[str, list] = {}
        for kind, recs in (("lease", s.leases), ("window", s.windows)):
            for who, h in recs.items():
                if h.get("pk") is None:
                    continue
                assert kind == "window" or h["w"] == 0, f"a lease under a window holds a prefix of its own: {h}"
                assert len(h["pk"]) == len(h["ps"]) == len(set(h["pk"])) > 0, h
                for k, ps in zip(h["pk"], h["ps"]):
                    holders.setdefault(k, []).append((kind, who, ps))
        assert set(holders) == set(s.prefixes), (holders, s.prefixes)
        saved = 0
        for k, rec in s.prefixes.items():
            assert rec["h"] == len(holders[k]) and rec["t"] > 0, (k, rec, holders[k])
            for kind, who, ps in holders[k]:
                assert 0 < ps <= rec["t"], (k, rec, kind, who, ps)
                saved += ps
            saved -= rec["t"]
        for t, l in s.leases.items():
            if l["w"] == 0 and t in self.tickets:
                info = self.tickets[t]
                assert l["t"] + sum(l.get("ps", [])) == info["need"], (t, l, info)
        assert int(s.ledger.get("psaved", 0)) == saved, (s.ledger.get("psaved"), saved, s.prefixes)

    @invariant()
    def leases_and_expiries_agree(self):
        s = self.state
        if s is None:
            return
        assert set(s.leases) == set(s.lease_exp), (set(s.leases) ^ set(s.lease_exp))
        for t, l in s.leases.items():
            assert l["w"] in (0, 1) and l["c"] in (0, 1)
            if l["w"] == 1:
                assert l["t"] == 0, f"a lease held under a window carries its own charge: {l}"

    @invariant()
    def waiters_fifo_alive_agree(self):
        s = self.state
        if s is None:
            return
        assert set(s.waiters) == set(s.alive), set(s.waiters) ^ set(s.alive)
        waiting = {t for t, w in s.waiters.items() if w["st"] == "w"}
        assert set(s.fifo) == waiting, (set(s.fifo), waiting)
        per_session: dict[str, list[str]] = {}
        for t in waiting:
            per_session.setdefault(s.waiters[t]["s"], []).append(t)
        for sess, ts in per_session.items():
            assert len(ts) == 1, f"session {sess} has several waiting attempts {ts}"
            assert s.sw.get(sess) == ts[0], (sess, s.sw.get(sess), ts)
        for sess, t in s.sw.items():
            assert t in s.waiters and s.waiters[t]["s"] == sess, (sess, t, s.waiters.get(t))
        assert len(set(s.fifo.values())) == len(s.fifo), f"two waiters share a FIFO place: {s.fifo}"

    @invariant()
    def windows_agree(self):
        s = self.state
        if s is None:
            return
        idle = {sess for sess, w in s.windows.items() if w["h"] == 0}
        assert set(s.window_exp) == idle, (s.window_exp, s.windows)
        if self.cfg.idle_grace_s == 0:
            assert not idle, f"idle windows with idle_grace_s=0: {s.windows}"
        if s.window_order is not None:
            # opening order of the live windows (the oldest is never revoked; held windows go youngest first)
            assert set(s.window_order) == set(s.windows), (s.window_order, s.windows)
            for sess, w in s.windows.items():
                assert s.window_order[sess] == w["id"], (sess, s.window_order[sess], w)
        for sess, w in s.windows.items():
            # a revoked window ends at its last release: it is never idle
            assert not (w.get("rv") == 1 and w["h"] == 0), (sess, w)
            holders = [t for t, l in s.leases.items()
                       if l["w"] == 1 and l["s"] == sess and self.lease_gen.get(t) == self.win_gen[sess]]
            assert w["h"] == len(holders), (
                f"window of {sess} says {w['h']} holders, live leases under it: {holders}; "
                f"window {w}, leases {s.leases}")

    # -- rules ------------------------------------------------------------------------------
    def acquire(self, ticket: str, probe: float) -> dict:
        info = self.tickets[ticket]
        pre = self.state
        fresh = pre.fresh(self.now, int(self.cfg.staleness_s * 1000))
        lease = pre.leases.get(ticket)
        # rule 4 and a stopped attempt are looked up before the bounded reap: a grant still
        # in the hash is claimable at / after its claim deadline
        held = lease is not None
        w = pre.waiters.get(ticket)
        stopped = not held and w is not None and w["st"] != "w"
        shared = {}
        if info.get("prefix") is not None:
            # as the client sends them: (key, leading tokens) levels, outermost first
            shared = {"prefixes": [[k, t] for k, t in info["prefix"]]}
        out = self.call("acquire", ticket=ticket, session=info["session"], need=info["need"], prompt=info["need"],
                        protected=1 if info["protected"] else 0, retain=1 if info["retain"] else 0,
                        probe=probe, **shared)
        o = out["o"]
        if self.in_hypothesis:
            event(f"acquire -> {o} {out['r']}")
        OUTCOMES[f"{o} {out['r']}"] += 1
        # predictions from the state before the step
        if held:
            assert o == "admit" and out["t"] == lease["t"], (out, lease)
            assert self.state.leases[ticket]["a"] == lease["a"], "rule 4 answered with a new lease"
        elif stopped:
            assert o == "preempted", (out, w)
            assert out["r"] == ("session_finished" if w["st"] == "f" else "preempted")
        elif info["protected"]:
            assert (o, out["r"]) == ("bypass", "protected"), out
        elif not fresh:
            assert (o, out["r"]) == ("bypass", "degraded"), out
        if ticket in self.seen_admit:
            assert o == "admit" and held, f"admitted ticket {ticket} answered {out}"
        self.check_aging(pre, ticket, w, out)
        # the model follows the answer
        self.waiting.discard(ticket)
        self.probing.discard(ticket)
        if o == "admit":
            assert ticket in self.state.leases
            assert self.state.leases[ticket]["c"] == 0, "an answered grant is claimed"
            self.seen_admit.setdefault(ticket, self.state.leases[ticket])
            self.held.add(ticket)
        elif o == "wait":
            assert ticket in self.state.fifo and ticket not in self.state.leases
            self.waiting.add(ticket)
        elif o == "probe":
            # the flow probes and calls again; a waiting attempt keeps its FIFO place meanwhile
            assert ticket not in self.state.leases
            assert (ticket in self.state.fifo) == (w is not None and w["st"] == "w"
                                                   and ticket in self.state.waiters), (out, w)
            self.probing.add(ticket)
        else:
            assert o in ("bypass", "preempted"), out
            assert ticket not in self.state.fifo and ticket not in self.state.leases
            rec = self.state.waiters.get(ticket)
            # a preempted record may stay while it holds its FIFO place (q) for the session's
            # newer attempt, which may be away probing (acquire.lua); it is out of the FIFO
            assert rec is None or (o == "preempted" and rec["st"] == "p" and rec.get("q") is not None), \
                (out, rec)
        return out

    def check_aging(self, pre: GateState, ticket: str, w: dict | None, out: dict) -> None:
        """SPEC 8: the head ages once the gate made no progress for max_wait_s, or once it
        waited max_wait_hard_s; nobody ages before that."""
        live = {t: q for t, q in pre.fifo.items() if pre.alive.get(t, 0) > self.now}
        head = min(live, key=live.get) if live else None
        due = False
        if w is not None and w["st"] == "w" and ticket == head:
            since = w.get("b", w["e"])
            stall_from = max(since, self.last_progress if self.last_progress is not None else since)
            due = (self.now - since >= int(self.cfg.max_wait_hard_s * 1000)
                   or self.now - stall_from >= int(self.cfg.max_wait_s * 1000))
        # progress made inside this very call (the bounded reap freed a lease or a window
        # before the decision) restarts the stall: the head may then rightly keep waiting
        reaped = self.last_progress == self.now
        if due and not reaped:
            assert out["o"] not in ("wait", "probe"), (out, w, self.now, self.last_progress)
        if out["o"] == "admit" and out["r"] == "aged" and ticket not in pre.leases:
            assert due, f"{ticket} aged early: {out}, waiter {w}, now {self.now}, progress {self.last_progress}"

    @rule(session=st.sampled_from(SESSIONS), need=st.integers(1, 1500), retain=st.booleans(),
          protected=st.sampled_from([False] * 9 + [True]),
          probe=st.one_of(st.just(None), st.floats(0.0, 1.0), st.sampled_from([0.0, 0.9, 1.0])),
          prefix=st.sampled_from([None, None, (("p0", 200),), (("p0", 600),), (("p1", 400),),
                                  (("sys", 100), ("p0", 300)), (("sys", 100), ("p1", 500)), (("sys", 150),)]))
    def acquire_new(self, session, need, retain, protected, probe, prefix=None):
        """``prefix``: the (key, leading tokens) levels the turn shares with others, outermost
        first: a system prompt under two tasks' prompts, and keys declared at two lengths (a
        later holder declaring more than a record charges gets what it charges). The script
        clamps them to the prompt (here the whole need)."""
        ticket = f"t{len(self.tickets):03d}"   # deterministic: Hypothesis replays draws by position
        self.tickets[ticket] = dict(session=session, need=need, retain=retain, protected=protected, prefix=prefix)
        if probe is None:
            probe = -1 if self.has_probe else -2
        self.acquire(ticket, probe)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def recheck_waiting(self, data):
        ticket = data.draw(st.sampled_from(sorted(self.waiting)))
        self.acquire(ticket, -1 if self.has_probe else -2)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data(), ms=st.one_of(st.integers(200, 1500), st.integers(1500, 2500)))
    def poll_cycle(self, data, ms):
        """A waiter's poll: time passes, then it re-checks (a poll of up to 2.5 s keeps it
        alive, liveness 3 s, and can cross max_wait_s, 2 s, in one step)."""
        self.advance_time(ms)
        self.recheck_waiting(data)

    @precondition(lambda self: self.probing)
    @rule(data=st.data(), ratio=st.one_of(st.just(-2.0), st.floats(0.0, 1.0), st.sampled_from([0.0, 0.9, 1.0])))
    def answer_probe(self, data, ratio):
        ticket = data.draw(st.sampled_from(sorted(self.probing)))
        self.acquire(ticket, ratio)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def recheck_held(self, data):
        ticket = data.draw(st.sampled_from(sorted(self.held)))
        if ticket in self.state.leases:
            self.acquire(ticket, -2)

    @precondition(lambda self: self.held)
    @rule(data=st.data(), twice=st.booleans())
    def release(self, data, twice):
        ticket = data.draw(st.sampled_from(sorted(self.held)))
        had = ticket in self.state.leases
        out = self.call("release", ticket=ticket, latency_ms=12.5, turn_index=1)
        assert out["released"] == (1 if had else 0), (out, had)
        assert ticket not in self.state.leases
        self.held.discard(ticket)
        if twice:
            assert self.call("release", ticket=ticket)["released"] == 0

    @precondition(lambda self: self.waiting or self.probing or self.held)
    @rule(data=st.data(), degraded=st.booleans())
    def cancel(self, data, degraded):
        # (a held ticket: an asyncio cancel that lands after Redis answered the claim)
        ticket = data.draw(st.sampled_from(sorted(self.waiting | self.probing | self.held)))
        pre = self.state
        w = pre.waiters.get(ticket)
        expect = "lease" if ticket in pre.leases else ("waiter" if w and w["st"] == "w" else "none")
        out = self.call("cancel", ticket=ticket, degraded=1 if degraded else 0)
        assert out["removed"] == expect, (out, expect)
        assert ticket not in self.state.leases and ticket not in self.state.waiters
        self.waiting.discard(ticket)
        self.probing.discard(ticket)
        self.held.discard(ticket)
        self.cancelled.add(ticket)

    @rule(session=st.sampled_from(SESSIONS))
    def finish_session(self, session):
        pre = self.state
        win = pre.windows.get(session)
        t = pre.sw.get(session)
        stopped = t if t and pre.waiters.get(t, {}).get("st") == "w" else ""
        out = self.call("finish_session", session=session)
        # the window's own charge, and each shared prefix's it was the last holder of
        recs = [pre.prefixes[k] for k in (win or {}).get("pk") or [] if k in pre.prefixes]
        freed = (win["t"] + sum(r["t"] for r in recs if r["h"] == 1)) if win else 0
        assert out["window"] == (1 if win else 0) and out["freed"] == freed, (out, win, recs)
        assert out["stopped"] == stopped, (out, stopped)
        assert session not in self.state.windows and session not in self.state.sw

    # mostly polls; sometimes past grace / liveness / claim / TTL; rarely past staleness
    @rule(ms=st.one_of(*([st.integers(0, 1500)] * 6 + [st.integers(2500, 12000)] * 3
                         + [st.integers(30000, 40000)])))
    def advance_time(self, ms):
        self.now += ms

    @rule(healthy=st.lists(st.booleans(), min_size=3, max_size=3),
          caps=st.lists(st.sampled_from([1000, 2000, 4000]), min_size=3, max_size=3),
          usage=st.one_of(st.sampled_from([0.0, 0.5, 0.84, 0.86, 0.9, 0.93, 1.0]), st.floats(0.0, 1.0)),
          measured=st.sampled_from([None, None, 0.5, 1.0, 2.5]),
          prefill=st.sampled_from([None, None, 1e-6, 1e-3, 1e-2]))
    def write_snapshot(self, healthy, caps, usage, measured=None, prefill=None):
        pre = self.state
        # a measured prefill cost orders the trim's idle windows (lua/includes/windows.lua)
        engines = [kvgate.EngineState(e, capacity_tokens=c, usage=usage, healthy=h, url=e,
                                      prefill_s_per_token=prefill)
                   for e, c, h in zip(ENGINE_IDS, caps, healthy)]
        params = snapshot_params(engines, measured)
        out = self.call("write_snapshot", **params)
        sig = "\n".join(sorted(e for e, h in zip(ENGINE_IDS, healthy) if h))
        old = pre.snap.get("healthy_sig")
        bumped = old is not None and old != sig
        assert out["bumped"] == (1 if bumped else 0), (out, old, sig)
        assert self.state.epoch == pre.epoch + (1 if bumped else 0)
        assert out["capacity"] == sum(c for c, h in zip(caps, healthy) if h)

    @rule(limit=st.integers(1, 20))
    def housekeep(self, limit):
        pre = self.state
        out = self.call("housekeep", limit=limit)
        post = self.state
        if (self.cfg.admission and self.cfg.residency and post.window_order is not None
                and post.fresh(self.now, int(self.cfg.staleness_s * 1000)) and limit >= len(pre.windows)):
            # an over-committed ledger (past the budget scale x the engines' capacity: hysteresis)
            # is trimmed (idle windows by room per cost, then held ones youngest first) down to
            # the ceiling (capacity x headroom x scale); the oldest window always stays. So once
            # trimming started, either what is left after the revoked windows end fits that, or
            # every window but the oldest is revoked
            cap = int(post.snap["capacity"])
            scale = post.scale(self.now, int(self.cfg.staleness_s * 1000), self.cfg.budget_scale)
            ceiling = math.floor(cap * self.cfg.headroom * scale)
            newly_rv = any(w.get("rv") == 1 and pre.windows.get(s_, {}).get("rv") != 1
                           for s_, w in post.windows.items())
            if post.reserved > cap * scale or out["revoked"] > 0 or newly_rv:
                revoked = sum(w["t"] for w in post.windows.values() if w.get("rv") == 1)
                oldest = min(post.window_order, key=post.window_order.get) if post.window_order else None
                rest = [s_ for s_, w in post.windows.items() if w.get("rv") != 1 and s_ != oldest]
                assert post.reserved - revoked <= ceiling or not rest, (
                    out, post.reserved, revoked, ceiling, post.windows)

    @rule(drain=st.booleans())
    def drain_stats(self, drain):
        out = self.call("drain_stats", drain=1 if drain else 0)
        s = self.state
        assert out["reserved"] == s.reserved and out["epoch"] == s.epoch
        assert out["leases"] == len(s.leases) and out["waiting"] == len(s.fifo)
        assert out["windows"] == len(s.windows)
        assert out["prefixes"] == len(s.prefixes) and out["psaved"] == int(s.ledger.get("psaved", 0))
        scale = s.scale(self.now, int(self.cfg.staleness_s * 1000), self.cfg.budget_scale)
        assert out["budget_scale"] == pytest.approx(scale)
        assert out["ceiling"] == math.floor(int(s.snap.get("capacity", 0)) * self.cfg.headroom * scale)

    @rule()
    def bump_epoch(self):
        pre = self.state
        out = self.call("bump_epoch")
        assert out["epoch"] == pre.epoch + 1


def test_gate_state_machine(redis_url):
    GateMachine.URL = redis_url
    phases = [Phase.explicit, Phase.generate] if os.environ.get("KVGATE_STATEFUL_NO_SHRINK") else list(Phase)
    run_state_machine_as_test(GateMachine, settings=settings(
        max_examples=int(os.environ.get("KVGATE_STATEFUL_EXAMPLES", "150")),
        stateful_step_count=int(os.environ.get("KVGATE_STATEFUL_STEPS", "40")),
        deadline=None, print_blob=True, phases=phases,
        database=(DirectoryBasedExampleDatabase(os.environ["KVGATE_STATEFUL_DB"])
                  if os.environ.get("KVGATE_STATEFUL_DB") else None),
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]))
    print("acquire outcomes reached:", dict(sorted(OUTCOMES.items())))


def _run_steps(machine: GateMachine, steps) -> None:
    """Drive the model by hand (a fixed sequence) with every invariant checked after each step."""
    checks = [machine.ledger_matches_leases_and_windows, machine.shared_prefixes_charged_once,
              machine.leases_and_expiries_agree, machine.waiters_fifo_alive_agree, machine.windows_agree]
    try:
        for step in steps:
            step()
            for c in checks:
                c()
    finally:
        machine.teardown()


def _ticket_of(machine: GateMachine, session: str) -> str:
    return [t for t, i in machine.tickets.items() if i["session"] == session][-1]


@pytest.mark.parametrize("end_window", ["finish_session", "bump_epoch"])
def test_released_lease_of_ended_window_leaves_newer_window(redis_url, end_window):
    GateMachine.URL = redis_url
    m = GateMachine()
    m.in_hypothesis = False
    m.setup(features=(False, True), grace=2.0, has_probe=False)
    first = {}

    def acquire(need):
        m.acquire_new(session="s0", need=need, retain=True, protected=False, probe=None)

    def remember():
        first["t"] = _ticket_of(m, "s0")

    def release_first():
        ticket = first["t"]
        out = m.call("release", ticket=ticket)
        assert out["released"] == 1
        m.held.discard(ticket)

    _run_steps(m, [
        lambda: m.write_snapshot(healthy=[True, False, False], caps=[4000, 4000, 4000], usage=0.9),
        lambda: acquire(100), remember,
        (lambda: m.finish_session("s0")) if end_window == "finish_session" else m.bump_epoch,
        lambda: acquire(300),      # opens a new window for the session's next turn
        release_first,             # the old turn ends: the new window must stay held
        lambda: m.advance_time(3000),
        lambda: m.housekeep(10),
    ])


def test_stale_preempted_place_is_not_inherited(redis_url):
    GateMachine.URL = redis_url
    m = GateMachine()
    m.in_hypothesis = False
    # (the preempted attempt's process is gone or slow: its "p" record lingers)
    m.setup(features=(False, True), grace=2.0, has_probe=False)

    def acq(session, need, probe):
        return lambda: m.acquire_new(session=session, need=need, retain=False, protected=False, probe=probe)

    _run_steps(m, [
        lambda: m.write_snapshot(healthy=[True, True, True], caps=[4000, 4000, 4000], usage=0.9),
        acq("s3", 500, 0.0),     # waits at place 1
        acq("s0", 100, 0.0),     # waits at place 2
        acq("s3", 300, 1.0),     # a retry: preempts place 1, enters by rule 7 (the place is used up)
        acq("s1", 100, 0.0),     # waits at place 3
        acq("s3", 200, 0.0),     # the session's next turn: must queue at the back, behind s0 and s1
    ])


def test_late_claim_of_a_grant_is_not_a_second_admission(redis_url):
    GateMachine.URL = redis_url
    m = GateMachine()
    m.in_hypothesis = False
    # (nobody reaps the grant before its waiter comes back)
    m.setup(features=(True, True), grace=0.0, has_probe=False, usage=0.86, cap=1000)
    claim_ms = 2 * int(m.cfg.wait_poll_s * 1000) + 1000

    class Pick:
        @staticmethod
        def draw(_):
            return "t000"

    _run_steps(m, [
        lambda: m.acquire_new(need=1, probe=None, protected=False, retain=False, session="s0"),   # waits
        lambda: m.write_snapshot(caps=[1000, 1000, 1000], healthy=[False, False, True], usage=0.0),  # granted
        lambda: m.advance_time(ms=claim_ms),       # the waiter comes back right at its claim deadline
        lambda: m.recheck_waiting(data=Pick()),    # must claim its grant, not be admitted anew
    ])


class _Pick:
    def __init__(self, ticket):
        self.ticket = ticket

    def draw(self, _):
        return self.ticket


@pytest.mark.parametrize("then", ["recheck_preempted", "cancel_the_prober_then_retry"])
def test_a_place_held_for_a_probing_retry(redis_url, then):
    # found by the machine above (2026-12-02): t001 preempts the waiting t000 and goes to
    # probe; t000's record keeps the place (q) for it. t000's own re-check is answered
    # "preempted" while the record stays; if t001 gives up while probing, the session's next
    # attempt takes the place the record still holds
    GateMachine.URL = redis_url
    m = GateMachine()
    m.in_hypothesis = False
    m.setup(features=(True, True), grace=0.0, has_probe=True, usage=0.86, cap=1000)

    def acq(probe):
        return lambda: m.acquire_new(need=1, probe=probe, protected=False, retain=False, session="s0")

    steps = [acq(0.0), acq(None)]
    if then == "recheck_preempted":
        steps += [lambda: m.poll_cycle(data=_Pick("t000"), ms=200)]
    else:
        steps += [lambda: m.cancel(degraded=False, data=_Pick("t001")), acq(0.0)]
    _run_steps(m, steps)
    if then == "cancel_the_prober_then_retry":
        assert m.state.fifo.get("t002") == 1.0  # the session's place, not the back


def test_a_waiter_behind_the_head_does_not_age_first(redis_url):
    # the model's aging check (SPEC 8) on a fixed sequence: two waiters stall past
    # max_wait_s; the one behind the head re-checks first and must keep waiting; the head
    # then ages, and the next head right after (an aged admission is not progress)
    GateMachine.URL = redis_url
    m = GateMachine()
    m.in_hypothesis = False
    m.setup(features=(True, False), grace=0.0, has_probe=False, usage=0.1, cap=1000)

    def acq(session, need):
        return lambda: m.acquire_new(session=session, need=need, retain=False, protected=False, probe=None)

    _run_steps(m, [
        acq("s0", 2500),                                   # fills the ledger (3 x 1000 x 0.9)
        acq("s1", 400), acq("s2", 400),                    # wait, s1 at the head
        lambda: m.poll_cycle(data=_Pick("t002"), ms=2500),  # s2 re-checks first: it must wait
        lambda: _assert_answer(m, "t002", "wait"),
        lambda: m.recheck_waiting(data=_Pick("t001")),     # the head ages
        lambda: _assert_answer(m, "t001", "admit"),
        lambda: m.recheck_waiting(data=_Pick("t002")),     # and then the new head, at once
        lambda: _assert_answer(m, "t002", "admit"),
    ])


def _assert_answer(m: GateMachine, ticket: str, outcome: str) -> None:
    if outcome == "wait":
        assert ticket in m.waiting, (ticket, m.state.fifo)
    else:
        assert ticket in m.held and m.state.leases[ticket]["r"] == "aged", (ticket, m.state.leases)
