"""Workload generator (seeded, reproducible) and JSONL trace replay, incl. bad lines."""
from __future__ import annotations

import json

import pytest

from kvgate.tools.bench.trace import load_trace, parse_trace
from kvgate.tools.bench.workload import (IntRange, ToolLatency, WorkloadSpec, for_step, generate, parse_range,
                                        session_tokens, turn_tokens)


def test_same_seed_same_workload_and_tokens():
    spec = WorkloadSpec(sessions=8, turns=IntRange(3, 9))
    a, b = generate(spec, seed=7), generate(spec, seed=7)
    assert a.sessions == b.sessions
    s = a.sessions[3]
    assert session_tokens(a, s.session_id, 2, 100) == session_tokens(b, s.session_id, 2, 100)


def test_different_seed_differs():
    spec = WorkloadSpec(sessions=8)
    a, b = generate(spec, seed=1), generate(spec, seed=2)
    assert a.sessions != b.sessions
    assert session_tokens(a, a.sessions[0].session_id, 0, 64) != session_tokens(b, b.sessions[0].session_id, 0, 64)


def test_sessions_do_not_share_token_prefixes():
    w = generate(WorkloadSpec(sessions=4), seed=0)
    firsts = [tuple(session_tokens(w, s.session_id, 0, 16)) for s in w.sessions]
    assert len(set(firsts)) == len(firsts)


def test_a_later_rollout_step_sends_the_same_shapes_as_new_sessions_and_tasks():
    w = generate(WorkloadSpec(sessions=8, turns=IntRange(3, 4), group_size=4, system_prompt=64), seed=3)
    assert for_step(w, 0) is w
    w2 = for_step(w, 2)
    assert [s.turns for s in w2.sessions] == [s.turns for s in w.sessions]
    assert [s.session_id for s in w2.sessions] == [s.session_id + "~2" for s in w.sessions]
    assert {s.group for s in w2.sessions}.isdisjoint({s.group for s in w.sessions})
    assert [w2.shared_prefix(s)[0] for s in w2.sessions] == [w.shared_prefix(s)[0] for s in w.sessions]
    a, b = turn_tokens(w, w.sessions[0], 0), turn_tokens(w2, w2.sessions[0], 0)
    assert a[:64] == b[:64] and a[64:] != b[64:]  # the same system prompt, a new task and session


def test_generated_shapes_follow_the_spec():
    spec = WorkloadSpec(sessions=50, turns=IntRange(5, 7), first_prompt=IntRange(100, 200),
                        tool_result=IntRange(10, 20), output=IntRange(3, 4))
    w = generate(spec, seed=3)
    assert len(w.sessions) == 50
    for s in w.sessions:
        assert 5 <= len(s.turns) <= 7
        assert 100 <= s.turns[0].new_tokens <= 200
        assert s.turns[0].gap_s == 0.0
        for t in s.turns[1:]:
            assert 10 <= t.new_tokens <= 20
            assert 0 < t.gap_s <= spec.tool.max_s
        assert all(3 <= t.output_tokens <= 4 for t in s.turns)
    # The working set counts every prompt and output token of each session.
    s0 = w.sessions[0]
    assert w.final_context_tokens(s0) == sum(t.new_tokens + t.output_tokens for t in s0.turns)


def test_default_tool_latency_is_heavy_tailed():
    d = generate(WorkloadSpec(sessions=200), seed=11).describe()
    assert d["tool_latency_p50_s"] < 1.0
    assert d["tool_latency_p90_s"] > 10.0
    assert d["turns_per_session_p50"] >= 10


def test_token_ids_stay_in_vocab():
    w = generate(WorkloadSpec(sessions=1, vocab=50), seed=0)
    toks = session_tokens(w, w.sessions[0].session_id, 0, 5000)
    assert len(toks) == 5000 and min(toks) >= 0 and max(toks) < 50


@pytest.mark.parametrize("text,expected", [("7", IntRange(7, 7)), ("3-9", IntRange(3, 9)), (5, IntRange(5, 5))])
def test_parse_range(text, expected):
    assert parse_range(text) == expected


@pytest.mark.parametrize("text", ["x", "9-3", "1-", "-4", "1.5"])
def test_parse_range_rejects(text):
    with pytest.raises(ValueError):
        parse_range(text, name="--turns")


@pytest.mark.parametrize("kw", [{"sessions": 0}, {"turns": IntRange(0, 3)}, {"output": IntRange(0, 0)},
                                {"arrival_spread_s": -1.0}])
def test_spec_validation(kw):
    with pytest.raises(ValueError):
        WorkloadSpec(**kw)


def test_tool_latency_validation():
    with pytest.raises(ValueError):
        ToolLatency(slow_frac=1.5)
    with pytest.raises(ValueError):
        ToolLatency(fast_median_s=0)


def _line(**kw):
    d = {"session": "a", "turn": 0, "input_tokens": 100, "output_tokens": 10, "gap_s": 0.0}
    d.update(kw)
    return json.dumps(d)


def test_trace_replay(tmp_path):
    lines = [
        _line(session="a", turn=0, input_tokens=100, output_tokens=10, gap_s=0.5),
        _line(session="b", turn=0, input_tokens=50, output_tokens=5, gap_s=0.0),
        "",
        "# a comment",
        _line(session="a", turn=1, input_tokens=150, output_tokens=20, gap_s=2.0),
        _line(session="a", turn=2, input_tokens=80, output_tokens=20, gap_s=1.0),  # context reset
    ]
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join(lines) + "\n")
    w = load_trace(p)
    assert [s.session_id for s in w.sessions] == ["a", "b"]
    a = w.sessions[0]
    assert a.start_s == 0.5
    assert [t.new_tokens for t in a.turns[:2]] == [100, 40]  # 150 - (100 + 10)
    assert a.turns[2].reset_to == 80
    assert [t.gap_s for t in a.turns] == [0.5, 2.0, 1.0]
    assert w.num_turns == 4


def test_trace_turns_may_arrive_out_of_order():
    w = parse_trace([_line(turn=1, input_tokens=200), _line(turn=0, input_tokens=100)])
    assert [t.turn for t in w.sessions[0].turns] == [0, 1]
    assert w.sessions[0].turns[1].new_tokens == 90


@pytest.mark.parametrize("bad,fragment", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    (json.dumps({"session": "a", "turn": 1}), "missing key"),
    (_line(turn=-1), "'turn'"),
    (_line(turn="3"), "'turn'"),
    (_line(input_tokens=0), "'input_tokens'"),
    (_line(output_tokens=1.5), "'output_tokens'"),
    (_line(gap_s=-2), "'gap_s'"),
    (_line(gap_s="soon"), "'gap_s'"),
    (_line(session=None), "'session'"),
    (_line(session=""), "'session'"),
])
def test_bad_trace_line_names_its_line_number(tmp_path, bad, fragment):
    p = tmp_path / "bad.jsonl"
    p.write_text("\n".join([_line(session="ok", turn=0), "", bad, _line(session="ok", turn=1, input_tokens=200)]))
    with pytest.raises(ValueError) as ei:
        load_trace(p)
    msg = str(ei.value)
    assert "line 3" in msg and fragment in msg


def test_duplicate_turn_names_both_lines():
    with pytest.raises(ValueError, match=r"line 2: duplicate turn 0 .*line 1"):
        parse_trace([_line(), _line()])


def test_empty_and_missing_trace(tmp_path):
    with pytest.raises(ValueError, match="empty"):
        parse_trace(["", "# nothing"])
    with pytest.raises(ValueError, match="cannot read"):
        load_trace(tmp_path / "nope.jsonl")


def test_trace_that_is_not_utf8_names_the_line(tmp_path):
    p = tmp_path / "latin1.jsonl"
    p.write_bytes((_line(turn=0) + "\n" + _line(turn=1, input_tokens=200) + "\n").encode()
                  + b'{"session": "caf\xe9", "turn": 0, "input_tokens": 5, "output_tokens": 1, "gap_s": 0}\n')
    with pytest.raises(ValueError, match=r"latin1.jsonl: line 3: not UTF-8 .*0xe9"):
        load_trace(p)


def test_json_line_separators_inside_a_string_stay_on_their_line(tmp_path):
    # JSON allows U+2028 / U+2029 / U+0085 raw inside strings (json.dumps(ensure_ascii=False)
    # writes them); str.splitlines() would cut such a line in two
    odd = "a\u2028b\u2029c\u0085d"
    p = tmp_path / "t.jsonl"
    p.write_text("\r\n".join([json.dumps(json.loads(_line(session=odd)), ensure_ascii=False),
                              _line(session="x", turn=0),
                              "{broken"]) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match="line 3: not valid JSON"):  # line numbers stay right
        load_trace(p)
    p.write_text("\r\n".join([json.dumps(json.loads(_line(session=odd)), ensure_ascii=False),
                              _line(session="x", turn=0)]) + "\r\n", encoding="utf-8")
    assert [s.session_id for s in load_trace(p).sessions] == [odd, "x"]


def test_a_session_id_spelled_as_number_and_string_is_an_error():
    with pytest.raises(ValueError, match=r"line 2: session '1' was a int on an earlier line"):
        parse_trace([_line(session=1, turn=0), _line(session="1", turn=1, input_tokens=200)])
    # one spelling throughout is fine, either way
    assert parse_trace([_line(session=1, turn=0), _line(session=1, turn=1, input_tokens=200)]).num_turns == 2


# ---- bounds: numbers that would exhaust memory or wait forever are bad lines ----------------

@pytest.mark.parametrize("bad,fragment", [
    (_line(input_tokens=10 ** 12), "'input_tokens'"),
    (_line(output_tokens=10 ** 12), "'output_tokens'"),
    (_line(input_tokens=1_500_000, output_tokens=1_000_000), "input_tokens + output_tokens"),
    (_line(gap_s=1e300), "'gap_s'"),
    (_line(gap_s=86_400.5), "'gap_s'"),
])
def test_trace_numbers_past_their_bounds_name_the_line(tmp_path, bad, fragment):
    p = tmp_path / "big.jsonl"
    p.write_text("\n".join([_line(session="ok", turn=0), bad]) + "\n")
    with pytest.raises(ValueError) as ei:
        load_trace(p)
    msg = str(ei.value)
    assert "line 2" in msg and fragment in msg


def test_trace_numbers_at_their_bounds_are_fine():
    from kvgate.tools.bench.workload import MAX_GAP_S, MAX_REQUEST_TOKENS

    w = parse_trace([_line(input_tokens=MAX_REQUEST_TOKENS - 10, output_tokens=10, gap_s=MAX_GAP_S)])
    assert w.sessions[0].turns[0].gap_s == MAX_GAP_S


def test_largest_request_names_the_trace_line():
    w = parse_trace([_line(turn=0, input_tokens=100, output_tokens=10),
                     "# comment",
                     _line(turn=1, input_tokens=400, output_tokens=50),
                     _line(turn=2, input_tokens=50, output_tokens=5)])  # a reset: smaller
    tokens, where = w.largest_request()
    assert tokens == 450 and "line 3" in where


def test_largest_request_of_a_generated_workload_is_its_biggest_final_context():
    w = generate(WorkloadSpec(sessions=5, turns=IntRange(3, 6)), seed=4)
    tokens, where = w.largest_request()
    assert tokens == max(w.final_context_tokens(s) for s in w.sessions)
    assert where.startswith("session s4-")


@pytest.mark.parametrize("kw", [{"first_prompt": IntRange(1, 10 ** 12)}, {"output": IntRange(1, 10 ** 9)},
                                {"tool_result": IntRange(0, 10 ** 9)}, {"sessions": 10 ** 7},
                                {"turns": IntRange(1, 10 ** 7)}, {"arrival_spread_s": 1e300},
                                {"arrival_spread_s": float("inf")}])
def test_spec_bounds(kw):
    with pytest.raises(ValueError):
        WorkloadSpec(**kw)


@pytest.mark.parametrize("kw", [{"max_s": 1e300}, {"max_s": float("inf")}])
def test_tool_latency_is_bounded(kw):
    with pytest.raises(ValueError):
        ToolLatency(**kw)
