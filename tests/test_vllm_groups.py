"""The bench's shared prefixes on a REAL CPU vLLM engine: the ids the workload generator draws for
a GRPO group's first prompt and for the system prompt are identical, so vLLM's prefix cache
stores them once and serves a sibling (and another task's system prompt) from it.

Run under the vLLM venv (scripts/setup-vllm-cpu.sh):
    .venv-vllm/bin/python -m pytest -m vllm tests/test_vllm_groups.py
"""
from __future__ import annotations

import sys

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]  # engine start alone took 200 s under load

try:
    import vllm  # noqa: F401
except Exception as e:  # noqa: BLE001 - any import failure means "no vLLM here"
    pytest.skip(f"vllm is not importable in this interpreter: {e}", allow_module_level=True)

from kvgate.tools.bench.workload import IntRange, WorkloadSpec, generate, turn_tokens
from kvgate.tools.vllm_testing import VOCAB, cached_tokens_of, complete, start_server

BS = 32


def test_siblings_and_tasks_hit_the_prefixes_they_share():
    w = generate(WorkloadSpec(sessions=8, group_size=4, turns=IntRange(1, 1), first_prompt=IntRange(300, 300),
                              system_prompt=100, vocab=VOCAB), seed=5)
    a, b, c = w.sessions[0], w.sessions[1], w.sessions[4]  # two samples of task 0, one of task 1
    assert a.group == b.group != c.group
    srv = start_server(num_blocks=80, block_size=BS, max_model_len=2048, python=sys.executable)
    try:
        first = cached_tokens_of(complete(srv.url, turn_tokens(w, a, 0), max_tokens=4))
        sibling = cached_tokens_of(complete(srv.url, turn_tokens(w, b, 0), max_tokens=4))
        other = cached_tokens_of(complete(srv.url, turn_tokens(w, c, 0), max_tokens=4))
    finally:
        srv.stop()
    assert first == 0
    # vLLM serves whole blocks and always computes the last prompt token
    assert sibling == (300 - 1) // BS * BS
    assert other == 100 // BS * BS
