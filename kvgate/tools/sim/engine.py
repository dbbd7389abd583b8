"""One simulated SGLang engine: DP-rank schedulers driven by asyncio tasks.

The engine runs on the event loop it is started on (``await engine.start()``);
every public method must be called from that loop's thread.
"""
from __future__ import annotations

import asyncio
import itertools
import time
import uuid
import zlib
from typing import Any, Dict, List, Optional, Sequence

from .cache import PrefixCache
from .profile import Profile, load_profile
from .scheduler import Iteration, RankScheduler, Req

_MAX_DEBT_S = 0.05   # how far the sim may lag behind real time before it stops catching up


class SimEngine:
    """A simulated SGLang server: ``dp_size`` schedulers, each with its own KV pool.

    ``time_scale`` multiplies every engine-time cost before it is slept
    (0.05 = 20x faster than real time; 0 = never sleep, only yield).
    """

    def __init__(self, profile: Any = None, *, time_scale: float = 1.0, tp_size: int = 1,
                 dp_size: int = 1, session_radix_cache: bool = False,
                 engine_id: str = "sim-engine", model_name: Optional[str] = None,
                 prefill_metrics: bool = False, **profile_overrides: Any) -> None:
        if isinstance(time_scale, bool) or not isinstance(time_scale, (int, float)) or time_scale < 0:
            raise ValueError(f"time_scale must be a number >= 0, got {time_scale!r}")
        for k, v in (("tp_size", tp_size), ("dp_size", dp_size)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{k} must be an integer >= 1, got {v!r}")
        self.profile: Profile = load_profile(profile, **profile_overrides)
        self.time_scale = float(time_scale)
        self.tp_size = tp_size
        self.dp_size = dp_size
        self.session_radix_cache = bool(session_radix_cache)
        # SIMULATOR ONLY, opt-in: export the engine's prefill time, which SGLang does not, so the
        # poller can measure a prefill cost and load as it does on vLLM (docs/simulator.md)
        self.prefill_metrics = bool(prefill_metrics)
        self.engine_id = engine_id
        self.model_name = model_name or self.profile.model_name
        self.ranks: List[RankScheduler] = [
            RankScheduler(self.profile, session_radix_cache=self.session_radix_cache)
            for _ in range(dp_size)]
        self._rr = itertools.cycle(range(dp_size))
        self._rid_rank: Dict[str, int] = {}
        self._open_sessions: set = set()   # ids opened with /open_session and not closed yet
        self._wake: List[Optional[asyncio.Event]] = [None] * dp_size
        # per rank, while an iteration is slept: (monotonic time it ends, its engine seconds)
        self._sleeping: List[Optional[tuple]] = [None] * dp_size
        self._tasks: List[asyncio.Task] = []
        self.started = False
        self.stopped = False
        self.wall_started = time.time()

    # ------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        if self.started:
            return
        self.started = True
        self._wake = [asyncio.Event() for _ in range(self.dp_size)]
        self._tasks = [asyncio.create_task(self._drive(i), name=f"{self.engine_id}-dp{i}")
                       for i in range(self.dp_size)]

    async def stop(self, message: str = "engine stopped") -> None:
        """Fail every pending request and stop the scheduler tasks."""
        self.stopped = True
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            try:
                await t
            except (asyncio.CancelledError, Exception):
                pass
        self._tasks = []
        for rank in self.ranks:
            rank._inflight = None
            rank.abort_all(message)

    async def _drive(self, i: int) -> None:
        rank = self.ranks[i]
        wake = self._wake[i]
        loop = asyncio.get_running_loop()
        scale = self.time_scale
        target = loop.time()
        while True:
            it: Optional[Iteration] = rank.begin_iteration()
            if it is None:
                wake.clear()
                await wake.wait()
                target = loop.time()
                continue
            if scale > 0:
                now = loop.time()
                target = max(target, now - _MAX_DEBT_S) + it.duration_s * scale
                delay = target - now
                self._sleeping[i] = (target, it.duration_s)
                try:
                    await asyncio.sleep(delay if delay > 0.0005 else 0)
                finally:
                    self._sleeping[i] = None
            else:
                await asyncio.sleep(0)
            rank.end_iteration(it)

    def _elapsed_in_iteration(self, i: int) -> float:
        """Engine seconds of rank ``i``'s iteration in flight that have passed (0: none is)."""
        sleeping = self._sleeping[i]
        if sleeping is None:
            return 0.0
        end, duration = sleeping
        remaining = max(0.0, end - time.monotonic()) / self.time_scale
        return max(0.0, duration - remaining)

    def _kick(self, i: int) -> None:
        ev = self._wake[i]
        if ev is not None:
            ev.set()

    # ------------------------------------------------------------- requests
    def pick_rank(self, session_id: Optional[str]) -> int:
        if self.dp_size == 1:
            return 0
        if session_id is not None:
            return zlib.crc32(session_id.encode()) % self.dp_size
        return next(self._rr)

    def validate(self, input_ids: Any, max_new_tokens: Any) -> None:
        """Raise ValueError for a request the engine would reject."""
        p = self.profile
        if not isinstance(input_ids, list) or not input_ids:
            raise ValueError("input_ids must be a non-empty list of token ids")
        V = p.vocab_size
        if set(map(type, input_ids)) != {int} or min(input_ids) < 0 or max(input_ids) >= V:
            bad = next((t for t in input_ids if type(t) is not int or not 0 <= t < V), None)
            raise ValueError(f"input_ids must hold integers in [0, {V}); got {bad!r}")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"sampling_params.max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
        total = len(input_ids) + max_new_tokens
        if len(input_ids) >= p.max_context:
            raise ValueError(f"The input ({len(input_ids)} tokens) is longer than the model's "
                             f"context length ({p.max_context} tokens).")
        if total > p.max_context:
            raise ValueError(f"Requested token count exceeds the model's maximum context length of "
                             f"{p.max_context} tokens ({len(input_ids)} input + {max_new_tokens} new).")
        cap = self.ranks[0].cache.capacity_tokens
        if total + p.block_size > cap:
            raise ValueError(f"request needs {total} tokens of KV but the pool holds {cap}")

    def submit(self, input_ids: List[int], max_new_tokens: int, *, rid: Optional[str] = None,
               session_id: Optional[str] = None, on_done=None) -> Req:
        if self.stopped:
            raise RuntimeError("engine stopped")
        self.validate(input_ids, max_new_tokens)
        if rid is None:
            rid = uuid.uuid4().hex
        elif rid in self._rid_rank:
            raise ValueError(f"a request with rid {rid!r} is already in flight")
        i = self.pick_rank(session_id)
        rank = self.ranks[i]

        def done(r: Req, _cb=on_done) -> None:
            self._rid_rank.pop(r.rid, None)
            if _cb is not None:
                _cb(r)

        r = Req(rid, input_ids, max_new_tokens, session_id=session_id, on_done=done)
        rank.submit(r, self._elapsed_in_iteration(i))
        self._rid_rank[rid] = i
        self._kick(i)
        return r

    async def generate(self, input_ids: List[int], max_new_tokens: int, *,
                       rid: Optional[str] = None, session_id: Optional[str] = None) -> Req:
        """Submit and wait for completion (in-process use, no HTTP)."""
        fut = asyncio.get_running_loop().create_future()

        def done(r: Req) -> None:
            if not fut.done():
                fut.set_result(r)

        r = self.submit(input_ids, max_new_tokens, rid=rid, session_id=session_id, on_done=done)
        try:
            return await fut
        except asyncio.CancelledError:
            self.abort(r.rid)
            raise

    def abort(self, rid: str) -> bool:
        i = self._rid_rank.get(rid)
        if i is None:
            return False
        ok = self.ranks[i].abort(rid)
        self._kick(i)
        return ok

    def abort_all(self) -> int:
        n = 0
        for rid in list(self._rid_rank):
            n += bool(self.abort(rid))
        return n

    def abort_request(self, rid: str) -> int:
        """SGLang's ``/abort_request`` for one rid: nothing happens unless a request with exactly
        that rid is in flight (the tokenizer manager drops unknown rids, with the default single
        tokenizer worker); then every in-flight request whose rid *starts with* it is aborted, as
        the scheduler matches ``req.rid.startswith(rid)``.  Returns how many were aborted."""
        if not rid or rid not in self._rid_rank:
            return 0
        return sum(bool(self.abort(q)) for q in [q for q in self._rid_rank if q.startswith(rid)])

    def open_session(self, session_id: Optional[str] = None) -> Optional[str]:
        """SGLang's ``/open_session``: returns the session id (a new uuid4 hex when none is
        given), or None when a session with that id is already open.  With the session radix
        cache it starts a new session generation on every rank (``open_radix_session``)."""
        if session_id is None:
            session_id = uuid.uuid4().hex
        elif session_id in self._open_sessions:
            return None
        self._open_sessions.add(session_id)
        if self.session_radix_cache:
            for rank in self.ranks:
                rank.open_session(session_id)
        return session_id

    def close_session(self, session_id: str) -> bool:
        self._open_sessions.discard(session_id)
        freed = False
        for i, rank in enumerate(self.ranks):
            if rank.close_session(session_id):
                freed = True
                self._kick(i)
        return freed

    def flush_cache(self) -> bool:
        """SGLang's ``/flush_cache``: drop every cached block (and session pins) when idle.

        Refused (False) while any request is running or queued, as SGLang does.
        Counters are kept.
        """
        if any(r.busy() or r._inflight is not None for r in self.ranks):
            return False
        for r in self.ranks:
            evicted = r.cache.evicted_blocks  # a counter (kvgate_sim:evicted_tokens_total) never goes back
            r.cache = PrefixCache(self.profile.kv_capacity_tokens, self.profile.block_size)
            r.cache.evicted_blocks = evicted
            r._session_gen.clear()     # SGLang: session_refs.reset()
        return True

    # -------------------------------------------------------------- queries
    def probe(self, prompt_ids: Sequence[int], session_id: Optional[str] = None) -> Dict[str, Any]:
        """The shared probe contract; read-only (no allocation, no stats)."""
        B = self.profile.block_size
        if session_id is not None or self.dp_size == 1:
            cached, total_blocks = self.ranks[self.pick_rank(session_id) if session_id is not None
                                              else 0].probe(prompt_ids)
        else:
            res = [r.probe(prompt_ids) for r in self.ranks]
            cached, total_blocks = max(c for c, _ in res), res[0][1]
        n = len(prompt_ids)
        ct = cached * B
        return {"cached_blocks": cached, "cached_tokens": ct, "total_blocks": total_blocks,
                "total_tokens": n, "hit_ratio": (ct / n) if n else 0.0, "block_size": B,
                "engine": self.engine_id}

    def usage(self) -> Dict[str, Any]:
        """The shared ``/kvgate/usage`` contract: worst rank's usage, blocks summed."""
        usage = max(r.cache.used_blocks / r.cache.num_blocks for r in self.ranks)
        return {"usage": usage,
                "num_gpu_blocks": sum(r.cache.num_blocks for r in self.ranks),
                "num_free_blocks": sum(r.cache.available_blocks() for r in self.ranks),
                "block_size": self.profile.block_size}

    def rank_state(self, i: int = 0) -> Dict[str, Any]:
        r = self.ranks[i]
        c = r.cache
        B = c.block_size
        used = c.used_blocks * B
        total = c.capacity_tokens
        return {
            "max_total_num_tokens": total,
            "num_used_tokens": used,
            "token_usage": used / total,
            "kv_available_tokens": c.free_blocks * B,
            "kv_evictable_tokens": c.evictable_blocks * B,
            "kv_cached_tokens": c.cached_blocks * B,
            "num_running_reqs": r.num_running,
            "num_queue_reqs": r.num_queued,
            "cache_hit_rate": r.cache_hit_rate(),
            "new_token_ratio": r.new_token_ratio,
            "open_sessions": len(r.sessions),
            "session_pinned_tokens": c.pinned_evictable_blocks * B,
            "prompt_tokens": r.prompt_tokens,
            "cached_tokens": r.cached_tokens,
            "generation_tokens": r.generation_tokens,
            "num_requests": r.num_requests,
            "num_aborted_requests": r.num_aborted,
            "retractions": r.retractions,
            "retracted_input_tokens": r.retracted_input_tokens,
            "retracted_output_tokens": r.retracted_output_tokens,
            "evicted_blocks": c.evicted_blocks,
            "evicted_tokens": c.evicted_blocks * B,
            "prefill_computed_tokens": r.prefill_computed_tokens,
            "prefill_seconds_wall": r.prefill_seconds * self.time_scale,
            "queue_seconds_wall": r.queue_seconds * self.time_scale,
            "queued_requests": r.queued_requests,
            "decode_steps": r.step,
            "engine_time_s": r.clock,
        }

    def stats(self) -> Dict[str, Any]:
        """Per-rank state plus totals (the ``GET /sim/stats`` body)."""
        ranks = [self.rank_state(i) for i in range(self.dp_size)]
        total = {k: sum(rs[k] for rs in ranks) for k in (
            "prompt_tokens", "cached_tokens", "generation_tokens", "num_requests",
            "num_aborted_requests", "retractions", "evicted_blocks", "evicted_tokens",
            "prefill_computed_tokens", "num_running_reqs", "num_queue_reqs", "num_used_tokens",
            "max_total_num_tokens")}
        total["hit_rate"] = (total["cached_tokens"] / total["prompt_tokens"]
                             if total["prompt_tokens"] else 0.0)
        return {"engine": self.engine_id, "model_name": self.model_name,
                "profile": self.profile.name, "time_scale": self.time_scale,
                "tp_size": self.tp_size, "dp_size": self.dp_size,
                "session_radix_cache": self.session_radix_cache,
                "block_size": self.profile.block_size, "ranks": ranks, "total": total}

    # -------------------------------------------------------------- metrics
    def metrics_text(self) -> str:
        """Prometheus text with SGLang's metric names and label sets."""
        mn = _esc(self.model_name)
        # tokenizer-side labels (SGLang's tokenizer_metric_labels()); the token and request
        # counters add is_streaming (the simulator has no streaming: always "false")
        tok_labels = f'model_name="{mn}",engine_type="unified"'
        stream_labels = tok_labels + ',is_streaming="false"'
        rank_labels: List[tuple] = []   # (label string, rank index)
        for dp in range(self.dp_size):
            for tp in range(self.tp_size):
                lab = (f'model_name="{mn}",engine_type="unified",tp_rank="{tp}",pp_rank="0",'
                       f'moe_ep_rank="0"')
                if self.dp_size > 1:
                    lab += f',dp_rank="{dp}"'
                rank_labels.append((lab, dp))
        states = [self.rank_state(i) for i in range(self.dp_size)]
        out: List[str] = []

        def fam(name: str, kind: str, doc: str, rows) -> None:
            out.append(f"# HELP {name} {doc}")
            out.append(f"# TYPE {name} {kind}")
            for lab, val in rows:
                out.append(f"{name}{{{lab}}} {float(val)!r}")

        def per_rank(name: str, kind: str, doc: str, key: str) -> None:
            fam(name, kind, doc, [(lab, states[dp][key]) for lab, dp in rank_labels])

        # tokenizer-side counters (one series per server)
        tot = lambda k: sum(s[k] for s in states)  # noqa: E731
        fam("sglang:prompt_tokens_total", "counter", "Number of prefill tokens processed.",
            [(stream_labels, tot("prompt_tokens"))])
        fam("sglang:generation_tokens_total", "counter", "Number of generation tokens processed.",
            [(stream_labels, tot("generation_tokens"))])
        fam("sglang:cached_tokens_total", "counter",
            "Number of cached prompt tokens by source (device/host/storage).",
            [(tok_labels + ',cache_source="device"', tot("cached_tokens"))])
        fam("sglang:num_requests_total", "counter", "Number of requests processed.",
            [(stream_labels, tot("num_requests"))])
        fam("sglang:num_aborted_requests_total", "counter", "Number of requests aborted.",
            [(tok_labels, tot("num_aborted_requests"))])
        # scheduler gauges (one series per rank; TP ranks repeat the same value)
        per_rank("sglang:num_running_reqs", "gauge", "The number of running requests.",
                 "num_running_reqs")
        per_rank("sglang:num_queue_reqs", "gauge", "The number of requests in the waiting queue.",
                 "num_queue_reqs")
        per_rank("sglang:num_used_tokens", "gauge", "The number of used tokens.", "num_used_tokens")
        per_rank("sglang:max_total_num_tokens", "gauge",
                 "Maximum total number of tokens in the KV cache pool.", "max_total_num_tokens")
        per_rank("sglang:token_usage", "gauge", "The token usage.", "token_usage")
        per_rank("sglang:full_token_usage", "gauge",
                 "The token usage for full attention layers.", "token_usage")
        per_rank("sglang:kv_used_tokens", "gauge", "KV tokens held by running requests (not evictable).",
                 "num_used_tokens")
        per_rank("sglang:kv_available_tokens", "gauge", "Free KV tokens.", "kv_available_tokens")
        per_rank("sglang:kv_evictable_tokens", "gauge",
                 "Cached KV tokens that can be evicted.", "kv_evictable_tokens")
        per_rank("sglang:cache_hit_rate", "gauge", "The prefix cache hit rate.", "cache_hit_rate")
        per_rank("sglang:new_token_ratio", "gauge", "The new token ratio.", "new_token_ratio")
        per_rank("sglang:num_retracted_requests_total", "counter",
                 "Total number of retracted requests.", "retractions")
        per_rank("sglang:num_retracted_input_tokens_total", "counter",
                 "Total number of retracted input tokens.", "retracted_input_tokens")
        per_rank("sglang:num_retracted_output_tokens_total", "counter",
                 "Total number of retracted output tokens.", "retracted_output_tokens")
        # a histogram with its +Inf bucket only: what the poller reads is its sum
        out.append("# HELP sglang:queue_time_seconds Histogram of queueing time in seconds.")
        out.append("# TYPE sglang:queue_time_seconds histogram")
        for lab, dp in rank_labels:
            n, total = float(states[dp]["queued_requests"]), float(states[dp]["queue_seconds_wall"])
            out.append(f'sglang:queue_time_seconds_bucket{{{lab},le="+Inf"}} {n!r}')
            out.append(f"sglang:queue_time_seconds_sum{{{lab}}} {total!r}")
            out.append(f"sglang:queue_time_seconds_count{{{lab}}} {n!r}")
        # SGLang's scheduler constants (emit_metrics_constants); vLLM's cache_config_info has no
        # SGLang counterpart
        B = self.profile.block_size
        fam("sglang:page_size", "gauge", "KV cache page size in tokens.",
            [(lab, B) for lab, dp in rank_labels])
        fam("sglang:num_pages", "gauge", "Number of KV cache pages.",
            [(lab, self.ranks[dp].cache.num_blocks) for lab, dp in rank_labels])
        fam("sglang:context_len", "gauge", "Maximum context length.",
            [(lab, self.profile.max_context) for lab, dp in rank_labels])
        # simulator-only series (no SGLang counterpart)
        per_rank("kvgate_sim:evicted_tokens_total", "counter",
                 "SIMULATOR ONLY: prefix-cache tokens evicted from the KV pool (LRU).",
                 "evicted_tokens")
        per_rank("kvgate_sim:prefill_computed_tokens_total", "counter",
                 "SIMULATOR ONLY: tokens actually prefilled (uncached + recomputed after retraction).",
                 "prefill_computed_tokens")
        if self.prefill_metrics:
            per_rank("kvgate_sim:prefill_seconds_total", "counter",
                     "SIMULATOR ONLY: seconds of prefill, summed over the requests of each prefill "
                     "batch (as vLLM's request_prefill_time_seconds), in wall time.",
                     "prefill_seconds_wall")
        per_rank("kvgate_sim:open_sessions", "gauge",
                 "SIMULATOR ONLY: sessions pinning KV (session radix cache); pinned KV is "
                 "evictable, after unpinned KV.",
                 "open_sessions")
        per_rank("kvgate_sim:session_pinned_tokens", "gauge",
                 "SIMULATOR ONLY: evictable KV tokens an open session pins (evicted after "
                 "unpinned KV; part of sglang:kv_evictable_tokens).", "session_pinned_tokens")
        return "\n".join(out) + "\n"


def _esc(s: str) -> str:
    return s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
