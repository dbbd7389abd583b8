"""Small real CPU vLLM engines for tests and benchmarks (dummy weights, token-id prompts).

Used by tests/test_vllm*.py and the scripts in benchmarks/ that run a real engine.  Nothing here is
needed in production.  Every server is started as a child process and stopped by pid; every wait is bounded.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import httpx

from kvgate._http import sync_client

TINY = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 2, "head_dim": 64}
HEAVY = {"hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 8,
         "num_key_value_heads": 8, "head_dim": 64}
VOCAB = 1000


def default_vllm_python() -> str:
    """The interpreter that runs a vLLM server: ``$KVGATE_VLLM_PYTHON``; else the venv that
    ``scripts/setup-vllm-cpu.sh`` builds (``$KVGATE_VLLM_VENV``, or ``.venv-vllm`` in this
    source tree) when it exists; else this interpreter (a user who installed vLLM beside
    kvgate, or who runs from inside that venv)."""
    explicit = os.environ.get("KVGATE_VLLM_PYTHON")
    if explicit:
        return explicit
    tree = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    venv = os.environ.get("KVGATE_VLLM_VENV") or os.path.join(tree, ".venv-vllm")
    candidate = os.path.join(venv, "bin", "python")
    return candidate if os.access(candidate, os.X_OK) else sys.executable


DEFAULT_VLLM_PYTHON = default_vllm_python()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_model(directory: str | None = None, heavy: bool = False, max_position: int = 4096) -> str:
    """Write a LlamaForCausalLM config.json (no weights: load with load_format="dummy")."""
    d = directory or tempfile.mkdtemp(prefix="kvgate-vllm-model-")
    shape = HEAVY if heavy else TINY
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB,
        "max_position_embeddings": max_position, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "bos_token_id": 1, "eos_token_id": 2, **shape,
    }
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    return d


def kv_bytes_per_block(heavy: bool = False, block_size: int = 32, dtype_bytes: int = 2) -> int:
    s = HEAVY if heavy else TINY
    return 2 * s["num_hidden_layers"] * block_size * s["num_key_value_heads"] * s["head_dim"] * dtype_bytes


def engine_kwargs(model_dir: str, num_blocks: int = 80, block_size: int = 32, max_model_len: int = 2048,
                  heavy: bool = False) -> dict:
    """Keyword arguments for vllm.LLM / AsyncEngineArgs giving a tiny prefix cache that really evicts."""
    return dict(model=model_dir, load_format="dummy", skip_tokenizer_init=True, enable_prefix_caching=True,
                block_size=block_size, max_model_len=max_model_len, num_gpu_blocks_override=num_blocks,
                kv_cache_memory_bytes=max(64 << 20, 2 * num_blocks * kv_bytes_per_block(heavy, block_size)),
                dtype="bfloat16", seed=0)


@dataclass
class VllmServer:
    """One `python -m vllm.entrypoints.openai.api_server` child process."""

    port: int
    proc: subprocess.Popen
    log_path: str
    model_dir: str
    num_blocks: int
    block_size: int
    extra: list = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, n: int = 40) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> None:
        """SIGTERM the server's process group (it spawns EngineCore), SIGKILL after 20 s."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(timeout=10)
        else:
            try:  # children may outlive a crashed parent
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def start_server(model_dir: str | None = None, *, heavy: bool = False, num_blocks: int = 80,
                 block_size: int = 32, max_model_len: int = 2048, plugins: str | None = "kvgate",
                 extra_args: tuple = (), python: str | None = None, wait_s: float = 600.0,
                 cwd: str = "/tmp", env: dict | None = None) -> VllmServer:
    """Start a real CPU vLLM OpenAI server on a free loopback port and wait (bounded) until it serves."""
    model_dir = model_dir or write_model(heavy=heavy)
    port = free_port()
    kv_bytes = max(64 << 20, 2 * num_blocks * kv_bytes_per_block(heavy, block_size))
    args = [python or sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", model_dir, "--served-model-name", "tiny", "--load-format", "dummy",
            "--skip-tokenizer-init", "--enable-prefix-caching", "--block-size", str(block_size),
            "--max-model-len", str(max_model_len), "--num-gpu-blocks-override", str(num_blocks),
            "--kv-cache-memory-bytes", str(kv_bytes), "--dtype", "bfloat16", "--seed", "0",
            "--enable-prompt-tokens-details", "--host", "127.0.0.1", "--port", str(port),
            "--disable-uvicorn-access-log", *extra_args]
    e = dict(os.environ)
    e.setdefault("PYTHONHASHSEED", "0")
    e.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if plugins is None:
        e.pop("VLLM_PLUGINS", None)
    else:
        e["VLLM_PLUGINS"] = plugins
    e.update(env or {})
    log_path = tempfile.mktemp(prefix="kvgate-vllm-server-", suffix=".log")
    log = open(log_path, "w")
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=cwd, env=e,
                            start_new_session=True)
    log.close()
    srv = VllmServer(port, proc, log_path, model_dir, num_blocks, block_size, list(extra_args))
    deadline = time.monotonic() + wait_s
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited ({proc.returncode}):\n{srv.log_tail()}")
            try:
                if httpx.get(srv.url + "/health", timeout=1.0).status_code == 200:
                    return srv
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"vLLM server not healthy after {wait_s}s:\n{srv.log_tail()}")
            time.sleep(0.5)
    except BaseException:
        srv.stop()
        raise


def _completion_body(prompt_ids: list[int], max_tokens: int) -> dict:
    """A greedy completion of exactly ``max_tokens`` tokens that returns its token ids."""
    return {"model": "tiny", "prompt": list(prompt_ids), "max_tokens": max_tokens, "temperature": 0,
            "return_token_ids": True, "ignore_eos": True}


def complete(url: str, prompt_ids: list[int], max_tokens: int = 8, timeout: float = 120.0,
             client: httpx.Client | None = None) -> dict:
    """One greedy /v1/completions call with a token-id prompt; returns the JSON answer."""
    body = _completion_body(prompt_ids, max_tokens)
    c = client or httpx
    r = c.post(url + "/v1/completions", json=body, timeout=timeout)
    r.raise_for_status()
    return r.json()


@dataclass
class Streamed:
    """What one streamed completion returned, with the client's clock at its first and last token."""
    token_ids: list[int]
    cached_tokens: int
    first_token_at: float  # time.monotonic() when the first token arrived
    last_token_at: float  # time.monotonic() when the last token arrived


def stream_complete(url: str, prompt_ids: list[int], max_tokens: int = 8, timeout: float = 120.0,
                    client: httpx.Client | None = None, on_first_token=None) -> Streamed:
    """One greedy streamed /v1/completions call with a token-id prompt.

    Between `first_token_at` and `last_token_at` the request is running in the engine, which lets a
    test tell what happened *during* a request from the engine's point of view rather than from the
    client's send and receive times.  `on_first_token()` is called once, when the first token arrives.
    """
    body = dict(_completion_body(prompt_ids, max_tokens), stream=True, stream_options={"include_usage": True})
    tokens: list[int] = []
    cached, first, last = 0, 0.0, 0.0
    c = client or sync_client(timeout=timeout)
    try:
        with c.stream("POST", url + "/v1/completions", json=body, timeout=timeout) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                for choice in chunk.get("choices") or ():
                    if choice.get("token_ids"):
                        last = time.monotonic()
                        if not tokens:
                            first = last
                            if on_first_token is not None:
                                on_first_token()
                        tokens.extend(choice["token_ids"])
                if chunk.get("usage"):
                    cached = cached_tokens_of(chunk)
    finally:
        if client is None:
            c.close()
    if not tokens:
        raise RuntimeError("the streamed completion returned no tokens")
    return Streamed(tokens, cached, first, last)


def cached_tokens_of(answer: dict) -> int:
    details = (answer.get("usage") or {}).get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


def metric_value(metrics_text: str, name: str) -> float:
    """Sum of the samples of one metric in a Prometheus text (enough for single-engine counters)."""
    total, seen = 0.0, False
    for line in metrics_text.splitlines():
        if line.startswith(name) and (line[len(name):len(name) + 1] in ("{", " ")):
            total += float(line.rsplit(" ", 1)[1])
            seen = True
    if not seen:
        raise KeyError(name)
    return total
