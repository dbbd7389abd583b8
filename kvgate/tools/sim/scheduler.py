"""Scheduler model of one SGLang scheduler (one DP rank), sans I/O.

The driver (``kvgate.tools.sim.engine``) calls :meth:`RankScheduler.begin_iteration`,
sleeps ``iteration.duration_s * time_scale`` and then calls
:meth:`RankScheduler.end_iteration`; all state changes happen inside those two
calls (and in submit / abort / close_session), so the model is deterministic and
testable with no clock at all. The module is over 400 lines on purpose: prefill
admission, the decode step, block growth, retraction and the cache's accounting all change
the one rank's state inside those calls, and split apart they would pass it back and forth.

What one iteration is, as in SGLang's event loop (``get_next_batch_to_run``):

* if queued requests fit, a **prefill** batch: FCFS from the head of the queue,
  stopping at the first request that does not fit (head-of-line, like SGLang's
  ``PrefillAdder``), bounded by ``max_running_requests`` and by
  ``max_prefill_tokens`` uncached tokens (the first request of a batch is always
  taken; SGLang would chunk it, the total time is the same).  Cost:
  ``prefill_base_s + uncached_tokens * prefill_s_per_token``.  Produces each
  request's first token.
* otherwise one **decode** step for the whole running batch: cost
  ``decode_step_base_s + decode_step_per_seq_s * batch + decode_s_per_kv_token *
  tokens_in_batch``.  Before the step, requests whose next token crosses a block
  boundary get one more block (evicting LRU cached blocks, session-pinned ones
  last); if the pool has nothing free or evictable, running requests are
  retracted in SGLang's ``retract_decode`` order (fewest generated tokens first,
  i.e. the newest; ties: longest prompt) until the block fits: each goes to the
  back of the queue, its KV freed, its progress recomputed on re-admission.  The
  last running request is never retracted (SGLang keeps one); if even it cannot
  grow it is aborted with status 500, as SGLang does.

A prompt matches at most ``(fill_len - 1) // block_size`` cached blocks: SGLang
matches at most ``input_len - 1`` tokens, so one token is always computed.

Admission uses SGLang's token budget: free + evictable tokens, minus
``new_token_ratio`` x the remaining decode budget of running requests, must cover
the new request's uncached prompt plus its remaining ``max_new_tokens``.
``new_token_ratio`` starts at 0.7, decays per decode step to 0.7*0.14 over 600
steps (SGLang's defaults) and after a retraction is re-estimated as SGLang does:
(tokens decoded by the remaining batch + 20 per request) / their max_new_tokens.

Per-request work is O(blocks of that request); per decode step the work is
O(requests that cross a block boundary or finish in that step), via buckets
keyed by step number, never O(running batch) or O(cache).
"""
from __future__ import annotations

import random
from collections import defaultdict, deque
from typing import Callable, Deque, Dict, List, Optional, Sequence, Tuple

from .cache import ROOT_HASH, PrefixCache, block_hashes
from .profile import Profile

WAITING, PREFILL, RUNNING, DONE = "waiting", "prefill", "running", "done"
_CLIP_MAX_NEW_TOKENS = 4096  # SGLang's CLIP_MAX_NEW_TOKENS_ESTIMATION
_HIT_WINDOW = 32


def abort_reason(message: str = "Aborted", status_code: Optional[int] = None,
                 err_type: Optional[str] = None) -> Dict[str, object]:
    """A finish reason shaped like SGLang's ``FINISH_ABORT.to_json()``."""
    return {"type": "abort", "message": message, "status_code": status_code, "err_type": err_type}


#: SGLang's answer for a request aborted while still in the waiting queue (tokenizer_manager
#: ``_handle_abort_req``: no status_code / err_type keys)
WAITING_ABORT = {"type": "abort", "message": "Abort in waiting queue"}


def output_tokens(digest: int, n: int, vocab_size: int) -> List[int]:
    """Deterministic output ids: the first ``n`` draws of a PRNG seeded by the prompt digest.

    Token ``i`` depends only on (prompt, i), so a retracted request regenerates the
    same prefix and two runs of the same rollout see the same histories.
    """
    if n <= 0:
        return []
    return random.Random(digest).choices(range(vocab_size), k=n)


class Req:
    """One generate request inside a scheduler."""

    __slots__ = ("rid", "input_ids", "prompt_len", "max_new", "session_id", "session_epoch",
                 "digest", "hashes", "fill_len", "hit", "held", "gen", "base", "epoch", "state",
                 "cached_tokens", "retractions", "admitted", "on_done", "output_ids",
                 "finish_reason", "t_submit", "t_first", "t_done", "seq", "aborted", "_match")

    def __init__(self, rid: str, input_ids: List[int], max_new_tokens: int,
                 session_id: Optional[str] = None,
                 on_done: Optional[Callable[["Req"], None]] = None) -> None:
        self.rid = rid
        self.input_ids = input_ids
        self.prompt_len = len(input_ids)
        self.max_new = max_new_tokens
        self.session_id = session_id
        self.session_epoch = 0
        self.digest = hash(tuple(input_ids))
        self.hashes: Optional[List[int]] = None   # full-block hashes of the fill tokens
        self.fill_len = self.prompt_len          # tokens to (re)compute: prompt + generated
        self.hit = 0                             # leading cached blocks at admission
        self.held = 0                            # blocks held: hit refs + private
        self.gen = 0                             # tokens generated so far (while not running)
        self.base = 0                            # gen(step) = base + step while running
        self.epoch = 0                           # invalidates stale step events
        self.state = WAITING
        self.cached_tokens = 0                   # hit of the first admission (meta_info)
        self.retractions = 0
        self.admitted = False
        self.on_done = on_done
        self.output_ids: List[int] = []
        self.finish_reason: Dict[str, object] = {}
        self.t_submit = 0.0                      # engine clock
        self.t_first = 0.0
        self.t_done = 0.0
        self.seq = 0
        self.aborted = False
        self._match: Tuple[int, int, int] = (-1, 0, 0)   # (cache version, hit blocks, pinned)


class Iteration:
    __slots__ = ("kind", "duration_s", "batch", "uncached_tokens")

    def __init__(self, kind: str, duration_s: float, batch: Sequence[Req] = (),
                 uncached_tokens: int = 0) -> None:
        self.kind = kind
        self.duration_s = duration_s
        self.batch = batch
        self.uncached_tokens = uncached_tokens


class RankScheduler:
    """KV pool, prefix cache, queue and running batch of one DP rank."""

    def __init__(self, profile: Profile, session_radix_cache: bool = False) -> None:
        self.profile = profile
        self.B = profile.block_size
        self.cache = PrefixCache(profile.kv_capacity_tokens, profile.block_size)
        self.session_radix_cache = session_radix_cache
        self.waiting: Deque[Req] = deque()
        self.running: Dict[str, Req] = {}        # admission order; newest last
        self.by_rid: Dict[str, Req] = {}
        self.step = 0                            # decode steps so far
        self.clock = 0.0                         # engine seconds elapsed (sum of iterations)
        self._grow_at: Dict[int, List[Tuple[Req, int]]] = defaultdict(list)
        self._finish_at: Dict[int, List[Tuple[Req, int]]] = defaultdict(list)
        self._sum_max_new = 0
        self._sum_base = 0
        self._sum_prompt = 0
        self._inflight: Optional[Iteration] = None
        self._abort_pending: List[Req] = []
        self._seq = 0
        init = profile.init_new_token_ratio
        self._ratio_init = init
        self._ratio_min = init * profile.min_new_token_ratio_factor
        self._ratio_decay = (init - self._ratio_min) / profile.new_token_ratio_decay_steps
        self.new_token_ratio = init
        # sessions (session radix cache), as SGLang's UnifiedSessionRefTracker: an open session
        # has a generation; a request takes its session's generation at submit (opening the
        # session if needed), close_session drops it, and a finishing turn pins its KV only if
        # its generation is still current.  Closed sessions leave no state here (SGLang keeps
        # up to 8192 tombstones, which change nothing once generations are checked).
        self._session_gen: Dict[str, int] = {}
        self._gen_counter = 0
        # counters (monotonic)
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.generation_tokens = 0
        self.num_requests = 0
        self.num_aborted = 0
        self.retractions = 0
        self.retracted_input_tokens = 0
        self.retracted_output_tokens = 0
        self.prefill_computed_tokens = 0
        self.prefill_seconds = 0.0  # engine seconds of prefill, per request (as vLLM observes them)
        self.queue_seconds = 0.0    # engine seconds requests waited before their first prefill
        self.queued_requests = 0    # requests whose queue time was observed
        self._hits: Deque[Tuple[int, int]] = deque()
        self._hit_sum = 0
        self._tok_sum = 0

    # ------------------------------------------------------------------ views
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_queued(self) -> int:
        return len(self.waiting)

    @property
    def sessions(self) -> Dict[str, Dict[int, None]]:
        """Session id -> the block hashes it pins (kept by the cache: eviction edits it)."""
        return self.cache.sessions

    def gen_of(self, r: Req) -> int:
        return r.base + self.step if r.state == RUNNING else r.gen

    def remaining_decode_tokens(self) -> int:
        return self._sum_max_new - (self._sum_base + len(self.running) * self.step)

    def kv_tokens_in_batch(self) -> int:
        return self._sum_prompt + self._sum_base + len(self.running) * self.step

    def cache_hit_rate(self) -> float:
        return self._hit_sum / self._tok_sum if self._tok_sum else 0.0

    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def probe(self, prompt_ids: Sequence[int]) -> Tuple[int, int]:
        """(leading cached full blocks, full blocks) of a prompt. Read-only."""
        hashes = block_hashes(prompt_ids, self.B)
        return self.cache.match(hashes), len(hashes)

    # --------------------------------------------------------------- requests
    def submit(self, r: Req, elapsed_s: float = 0.0) -> None:
        """Queue ``r``; ``elapsed_s``: the engine time of the iteration in flight that had passed
        when it arrived (the clock moves only at an iteration's end), for its queue time."""
        if r.rid in self.by_rid:
            raise ValueError(f"duplicate rid {r.rid!r}")
        if r.session_id is not None and self.session_radix_cache:
            g = self._session_gen.get(r.session_id)
            r.session_epoch = g if g is not None else self.open_session(r.session_id)
        r.t_submit = self.clock + elapsed_s
        self._seq += 1
        r.seq = self._seq
        r.state = WAITING
        self.by_rid[r.rid] = r
        self.waiting.append(r)

    def abort(self, rid: str) -> bool:
        r = self.by_rid.get(rid)
        if r is None or r.state == DONE:
            return False
        if r.state == WAITING:
            self.waiting.remove(r)
            self._finish(r, dict(WAITING_ABORT), aborted=True)
        elif self._inflight is not None:
            if not r.aborted:
                r.aborted = True
                self._abort_pending.append(r)
        else:
            self._drop_running(r)
            self._finish(r, abort_reason(), aborted=True)
        return True

    def abort_all(self, message: str = "engine stopped") -> None:
        for r in list(self.by_rid.values()):
            if r.state == WAITING:
                self.waiting.remove(r)
            elif r.state in (RUNNING, PREFILL):
                self._drop_running(r)
            self._finish(r, abort_reason(message, 503), aborted=True)

    def open_session(self, session_id: str) -> int:
        """Start a new generation of ``session_id`` (SGLang's ``open_radix_session``):
        turns submitted before it no longer pin when they finish."""
        self._gen_counter += 1
        self._session_gen[session_id] = self._gen_counter
        return self._gen_counter

    def close_session(self, session_id: str) -> bool:
        """Drop a session's pins: its KV returns to plain LRU eviction. Idempotent.
        True when the session pinned something."""
        self._session_gen.pop(session_id, None)
        return self.cache.drop_session(session_id)

    # -------------------------------------------------------------- iteration
    def begin_iteration(self) -> Optional[Iteration]:
        if self._inflight is not None:
            raise RuntimeError("begin_iteration called twice without end_iteration")
        for _ in range(3):
            batch, uncached = self._build_prefill_batch()
            if batch:
                p = self.profile
                it = Iteration("prefill", p.prefill_base_s + uncached * p.prefill_s_per_token,
                               batch, uncached)
                self._inflight = it
                return it
            if not self.running:
                return None
            self._grow_for_next_step()
            if self.running:
                p = self.profile
                dur = (p.decode_step_base_s + p.decode_step_per_seq_s * len(self.running)
                       + p.decode_s_per_kv_token * self.kv_tokens_in_batch())
                it = Iteration("decode", dur)
                self._inflight = it
                return it
            # every running request was retracted: try a prefill again
        return None

    def end_iteration(self, it: Iteration) -> List[Req]:
        if it is not self._inflight:
            raise RuntimeError("end_iteration for an iteration that is not in flight")
        self._inflight = None
        self.clock += it.duration_s
        done: List[Req] = []
        if it.kind == "prefill":
            self.prefill_seconds += it.duration_s * len(it.batch)
            for r in it.batch:
                self._prefill_done(r, done)
        else:
            self.step += 1
            self.new_token_ratio = max(self._ratio_min, self.new_token_ratio - self._ratio_decay)
            for r, ep in self._finish_at.pop(self.step, ()):
                if r.epoch == ep and r.state == RUNNING and not r.aborted:
                    self._complete(r)
                    done.append(r)
        if self._abort_pending:
            pend, self._abort_pending = self._abort_pending, []
            for r in pend:
                if r.state in (RUNNING, PREFILL):
                    self._drop_running(r)
                    self._finish(r, abort_reason(), aborted=True)
                    done.append(r)
        return done

    # ---------------------------------------------------------------- prefill
    def _fill_tokens(self, r: Req) -> List[int]:
        if r.gen == 0:
            return r.input_ids
        return r.input_ids + output_tokens(r.digest, r.gen, self.profile.vocab_size)

    def _build_prefill_batch(self) -> Tuple[List[Req], int]:
        if not self.waiting:
            return [], 0
        p, B, cache = self.profile, self.B, self.cache
        batch: List[Req] = []
        uncached_total = 0
        budget = p.max_prefill_tokens
        reserved_batch = 0
        running_reserve = self.new_token_ratio * self.remaining_decode_tokens()
        while self.waiting and len(self.running) + len(batch) < p.max_running_requests:
            r = self.waiting[0]
            if r.hashes is None:
                r.hashes = block_hashes(self._fill_tokens(r), B)
                r._match = (-1, 0, 0)
            ver, k, pinned = r._match
            if ver != cache.version:   # a blocked head is re-checked every step: reuse
                # SGLang matches at most input_len - 1 tokens (_compute_max_prefix_len):
                # at least one token is always computed, so a fully cached prompt is not 100%
                k = cache.match(r.hashes, (r.fill_len - 1) // B)
                pinned = cache.evictable_among(r.hashes[:k]) if k else 0
                r._match = (cache.version, k, pinned)
            uncached = r.fill_len - k * B
            if batch and uncached > budget:
                break
            need = -(-(r.fill_len + 1) // B) - k
            avail = cache.available_blocks() - pinned
            if need > avail:
                break
            reserve = min(max(r.max_new - r.gen, 0), _CLIP_MAX_NEW_TOKENS)
            if (batch or self.running) and (
                    (need + pinned) * B + reserve
                    > cache.available_blocks() * B - running_reserve - reserved_batch):
                break
            self.waiting.popleft()
            if k:
                cache.acquire(r.hashes[:k])
            ok = cache.alloc_private(need)
            assert ok
            r.hit, r.held = k, k + need
            if not r.admitted:
                r.admitted = True
                r.cached_tokens = k * B
                # SGLang's queue_time_seconds: observed once, when a request first leaves the queue
                self.queue_seconds += max(0.0, self.clock - r.t_submit)
                self.queued_requests += 1
            r.state = PREFILL
            r.epoch += 1
            batch.append(r)
            reserved_batch += reserve
            uncached_total += uncached
            budget -= uncached
        return batch, uncached_total

    def _prefill_done(self, r: Req, done: List[Req]) -> None:
        if r.aborted or r.state != PREFILL:
            return  # handled by the abort path
        hashes = r.hashes
        self.cache.commit(hashes[r.hit:])
        self.prefill_computed_tokens += r.fill_len - r.hit * self.B
        if r.retractions == 0:
            self._record_hit(r.cached_tokens, r.prompt_len)
            r.t_first = self.clock
        if r.max_new > 0:
            r.gen += 1
        r.state = RUNNING
        r.base = r.gen - self.step
        self.running[r.rid] = r
        self._sum_max_new += r.max_new
        self._sum_base += r.base
        self._sum_prompt += r.prompt_len
        if r.gen >= r.max_new:
            self._complete(r)
            done.append(r)
            return
        self._finish_at[r.max_new - r.base].append((r, r.epoch))
        self._schedule_growth(r)

    def _schedule_growth(self, r: Req) -> None:
        # the step whose token no longer fits in the blocks held
        s_grow = r.held * self.B - r.prompt_len + 1 - r.base
        if s_grow <= r.max_new - r.base:
            self._grow_at[max(s_grow, self.step + 1)].append((r, r.epoch))

    # ----------------------------------------------------------------- decode
    def _grow_for_next_step(self) -> None:
        s1 = self.step + 1
        events = self._grow_at.pop(s1, None)
        if not events:
            return
        cache = self.cache
        for r, ep in events:
            if r.epoch != ep or r.state != RUNNING:
                continue
            retracted = False
            while not cache.alloc_private(1):
                if len(self.running) <= 1:
                    # SGLang's retract_decode always keeps one request; if even the last one
                    # cannot grow it is aborted (HTTP 500), never left queued with nothing running
                    self._drop_running(r)
                    self._finish(r, abort_reason(
                        "Out of memory even after retracting all other requests in the decode "
                        "batch. Aborting the last request.", 500), aborted=True)
                    break
                # SGLang's retract_decode order: fewest generated tokens first (the
                # newest request, in practice), ties broken by the longest prompt
                victim = min(self.running.values(), key=lambda q: (q.base, -q.prompt_len))
                self._retract(victim)
                retracted = True
                if victim is r:
                    break
            if retracted:
                self._reset_ratio_after_retract()
            if r.state == RUNNING:
                r.held += 1
                self._schedule_growth(r)

    def _retract(self, r: Req) -> None:
        gen = r.base + self.step
        self._drop_running(r)
        self.retractions += 1
        self.retracted_input_tokens += r.prompt_len
        self.retracted_output_tokens += gen
        r.gen = gen
        r.fill_len = r.prompt_len + gen
        r.hashes = None
        r.retractions += 1
        r.state = WAITING
        self.waiting.append(r)      # SGLang: _extend_requests_to_queue(retracted)

    def _reset_ratio_after_retract(self) -> None:
        """SGLang's retract_decode estimate: (decoded + 20 steps per request) / max_new."""
        n = len(self.running)
        if n and self._sum_max_new > 0:
            decoded = self._sum_base + n * self.step
            self.new_token_ratio = min(1.0, (decoded + 20 * n) / self._sum_max_new)
        else:
            self.new_token_ratio = self._ratio_init

    def _drop_running(self, r: Req) -> None:
        """Free everything a running/prefilling request holds (no cache insertion)."""
        cache = self.cache
        if r.state == RUNNING:
            r.gen = r.base + self.step
            del self.running[r.rid]
            self._sum_max_new -= r.max_new
            self._sum_base -= r.base
            self._sum_prompt -= r.prompt_len
            committed = len(r.hashes)
        else:  # PREFILL: only the hit blocks are cached yet
            committed = r.hit
        cache.free_private(r.held - committed)
        cache.release(r.hashes[:committed])
        r.epoch += 1
        r.held = 0

    # ----------------------------------------------------------------- finish
    def _complete(self, r: Req) -> None:
        """Finished by length: cache prompt + output[:-1] and release."""
        B, cache = self.B, self.cache
        out = output_tokens(r.digest, r.max_new, self.profile.vocab_size)
        hashes = r.hashes
        seq_len = r.prompt_len + max(r.max_new - 1, 0)
        start = len(hashes) * B
        new: List[int] = []
        if seq_len - start >= B:
            seq = r.input_ids + out[:max(r.max_new - 1, 0)]
            new = block_hashes(seq, B, parent=hashes[-1] if hashes else ROOT_HASH, start=start)
        del self.running[r.rid]
        self._sum_max_new -= r.max_new
        self._sum_base -= r.base
        self._sum_prompt -= r.prompt_len
        cache.commit(new)
        cache.free_private(r.held - len(hashes) - len(new))
        all_h = hashes + new if new else hashes
        sid = r.session_id
        if (self.session_radix_cache and sid is not None
                and self._session_gen.get(sid) == r.session_epoch):
            cache.set_session(sid, all_h)   # pins: eviction order only, not a lock
        cache.release(all_h)
        r.held = 0
        r.gen = r.max_new
        r.epoch += 1
        r.output_ids = out
        self.prompt_tokens += r.prompt_len
        self.cached_tokens += r.cached_tokens
        self.generation_tokens += r.max_new
        self.num_requests += 1
        self._finish(r, {"type": "length", "length": r.max_new})

    def _finish(self, r: Req, reason: Dict[str, object], aborted: bool = False) -> None:
        r.state = DONE
        r.finish_reason = reason
        r.t_done = self.clock
        self.by_rid.pop(r.rid, None)
        if aborted:
            r.aborted = True
            self.num_aborted += 1
            if not r.output_ids and r.gen:
                r.output_ids = output_tokens(r.digest, r.gen, self.profile.vocab_size)
        cb = r.on_done
        if cb is not None:
            r.on_done = None
            cb(r)

    def _record_hit(self, hit: int, total: int) -> None:
        self._hits.append((hit, total))
        self._hit_sum += hit
        self._tok_sum += total
        if len(self._hits) > _HIT_WINDOW:
            h, t = self._hits.popleft()
            self._hit_sum -= h
            self._tok_sum -= t
