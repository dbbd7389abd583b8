"""The bench's shared prefixes: GRPO groups and a system prompt in the generator and in traces
(identical token ids where shared, so the engines' block hashes match), the grpo scenarios,
the -noshare gate policies, the check against them, and re-prefill that knows what a sibling
sent before."""
from __future__ import annotations

import json

import pytest

from kvgate.tools.bench.checks import SHARE_VS_NOSHARE, checks
from kvgate.tools.bench.engines import Counters
from kvgate.tools.bench.flags import MATRIX_POLICIES, matrix_policies
from kvgate.tools.bench.policies import NOSHARE_GATE, Policy, parse_policies
from kvgate.tools.bench.runner import PolicyResult, TurnRecord
from kvgate.tools.bench.scenarios import SCENARIOS
from kvgate.tools.bench.summary import _shared_seen, _unavoidable_tokens, summarize
from kvgate.tools.bench.trace import parse_trace
from kvgate.tools.bench.workload import IntRange, WorkloadSpec, generate, turn_tokens
from kvgate.tools.sim.cache import block_hashes

GROUPED = WorkloadSpec(sessions=12, group_size=4, turns=IntRange(3, 5), first_prompt=IntRange(600, 900),
                       system_prompt=200, tool_result=IntRange(20, 40), output=IntRange(5, 10))


def test_samples_of_a_task_send_one_first_prompt_and_every_task_one_system_prompt():
    w = generate(GROUPED, seed=3)
    groups = [s.group for s in w.sessions]
    assert groups == [g for g in groups[::4] for _ in range(4)] and len(set(groups)) == 3
    firsts = [turn_tokens(w, s, 0) for s in w.sessions]
    for k in range(0, 12, 4):
        assert all(f == firsts[k] for f in firsts[k:k + 4]), "siblings send the same first prompt"
        assert w.sessions[k].shared_tokens == len(firsts[k])
        assert w.shared_prefix(w.sessions[k]) == (("system", 200), (f"group:{groups[k]}", len(firsts[k])))
    assert all(f[:200] == firsts[0][:200] for f in firsts), "one system prompt"
    assert firsts[0][200:216] != firsts[4][200:216], "tasks differ past it"
    # the same ids hash to the same blocks, so the engine's prefix cache stores them once
    assert block_hashes(firsts[0], 16)[:12] == block_hashes(firsts[4], 16)[:12]
    assert block_hashes(firsts[0], 16) == block_hashes(firsts[1], 16)
    # then they diverge: later turns are each sample's own
    assert turn_tokens(w, w.sessions[0], 1) != turn_tokens(w, w.sessions[1], 1)
    # each shared prefix counted once: 3 task prompts, the system prompt once among them
    firsts_len = sum(len(f) for f in firsts)
    assert w.fresh_tokens() - w.distinct_prompt_tokens() == firsts_len - sum(map(len, firsts[::4])) + 2 * 200


def test_a_workload_without_groups_draws_what_it_always_drew():
    spec = WorkloadSpec(sessions=5, turns=IntRange(3, 6))
    w = generate(spec, seed=4)
    assert all(s.group is None and s.shared_tokens == 0 for s in w.sessions) and w.system_tokens == 0
    assert "group_size" not in w.spec and "system_prompt" not in w.spec
    assert w.distinct_prompt_tokens() == w.fresh_tokens()
    from kvgate.tools.bench.workload import session_tokens
    s = w.sessions[2]
    assert turn_tokens(w, s, 0) == session_tokens(w, s.session_id, 0, s.turns[0].new_tokens)
    assert all(w.shared_prefix(s) == () for s in w.sessions)


@pytest.mark.parametrize("kw, fragment", [(dict(group_size=0), "group size"),
                                          (dict(system_prompt=901), "system prompt"),
                                          (dict(system_prompt=-1), "system prompt")])
def test_group_spec_validation(kw, fragment):
    with pytest.raises(ValueError, match=fragment):
        WorkloadSpec(first_prompt=IntRange(900, 1000), **kw)


def _line(**kw):
    base = {"session": "a", "turn": 0, "input_tokens": 100, "output_tokens": 10, "gap_s": 0.0}
    base.update(kw)
    return json.dumps(base)


def test_a_trace_says_which_sessions_share_a_prompt():
    w = parse_trace([_line(session="a", group="t1", shared_tokens=80, system_tokens=30),
                     _line(session="b", group="t1", shared_tokens=80, input_tokens=90),
                     _line(session="a", turn=1, input_tokens=150),
                     _line(session="c", input_tokens=120)])
    a, b, c = w.sessions
    assert (a.group, a.shared_tokens, c.group, w.system_tokens) == ("t1", 80, None, 30)
    assert turn_tokens(w, a, 0)[:80] == turn_tokens(w, b, 0)[:80]
    assert turn_tokens(w, a, 0)[:30] == turn_tokens(w, c, 0)[:30] != turn_tokens(w, c, 0)[:31]
    assert w.shared_prefix(c) == (("system", 30),)
    assert w.shared_prefix(a) == (("system", 30), ("group:t1", 80))


@pytest.mark.parametrize("lines, fragment", [
    ([_line(group="x"), _line(turn=1, input_tokens=150, group="y")], "samples one task"),
    ([_line(group="x", shared_tokens=101)], "'shared_tokens' must be an integer in"),
    ([_line(group="x", shared_tokens=50), _line(session="b", group="x", shared_tokens=60)], "a group has one prompt"),
    ([_line(shared_tokens=50)], "gives 'shared_tokens' but no 'group'"),
    ([_line(system_tokens=20), _line(session="b", system_tokens=30)], "one system prompt"),
    ([_line(), _line(turn=1, input_tokens=150, shared_tokens=10, group="x")], "belongs on session"),
    ([_line(system_tokens=50), _line(session="b", input_tokens=40)], "shorter than the system prompt"),
    ([_line(group=True)], "'group' must be"),
])
def test_bad_sharing_keys_in_a_trace_are_errors(lines, fragment):
    with pytest.raises(ValueError, match=fragment):
        parse_trace(lines)


def test_grpo_scenarios_share_and_the_matrix_runs_the_gate_without_sharing_beside():
    for name in ("grpo", "grpo-long"):
        sc = SCENARIOS[name]
        assert sc.group_size == 8 and sc.system_prompt == 2048
        assert matrix_policies(sc) == f"{MATRIX_POLICIES},{NOSHARE_GATE}"
    assert matrix_policies(SCENARIOS["default"]) == MATRIX_POLICIES


def test_noshare_policies():
    ps = parse_policies("kvgate,kvgate-noshare,admission-noshare[max_wait_s=600]", [])
    assert [(p.name, p.kind, p.share_prefix, p.admission, p.residency) for p in ps] == [
        ("kvgate", "gate", True, True, True), ("kvgate-noshare", "gate", False, True, True),
        ("admission-noshare[max_wait_s=600]", "gate", False, True, False)]
    assert ps[2].knobs == (("max_wait_s", 600.0),)
    for bad in ("none-noshare", "cap-noshare", "kvgate-noshare[nope=1]"):
        with pytest.raises(ValueError):
            parse_policies(bad, [])


def _rec(session, turn, start, prompt, cached, out=10):
    return TurnRecord(session=session, turn=turn, ready_s=start, start_s=start, done_s=start + 0.1,
                      prompt_tokens=prompt, cached_tokens=cached, output_tokens=out, outcome="admit", reason="open")


def test_reprefill_knows_what_a_sibling_sent_first():
    w = parse_trace([_line(session="a", group="t", shared_tokens=64, input_tokens=100),
                     _line(session="b", group="t", shared_tokens=64, input_tokens=100, gap_s=1.0)])
    recs = [_rec("a", 0, 0.0, 100, 0), _rec("b", 0, 1.0, 100, 0)]
    assert _shared_seen(recs, w) == {"b": 64}
    # b's 64 shared tokens (4 whole blocks) could have come from a's: not unavoidable
    assert _unavoidable_tokens(recs, 16, shared=_shared_seen(recs, w)) == 100 + 36
    res = PolicyResult(policy=Policy("none", "none"), wall_s=1.0, turns=recs, counters=Counters(0, 200),
                       samples=[], usage_samples=[])
    assert summarize([res], w, block_size=16)["policies"][0]["reprefill_tokens"] == 64


def test_the_check_against_the_gate_without_sharing():
    def row(policy, wall):
        return {"policy": policy, "kind": "gate" if policy.startswith("kvgate") else "none", "wall_s": wall,
                "errors": 0, "ratio_to_none": None}
    for wall, ok in ((7.9, True), (8.1, False)):
        s = {"policies": [row("none", 9.0), row("kvgate", wall), row(NOSHARE_GATE, 10.0)], "best_cap": None}
        got = {n: v for n, v, _ in checks(s, "grpo", caps_are_no_gate=True)}
        title = f"kvgate at most {SHARE_VS_NOSHARE:g}x the same gate told nothing of shared prefixes ({NOSHARE_GATE})"
        assert got[title] is ok
