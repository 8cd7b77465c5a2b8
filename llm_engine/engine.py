"""The synchronous speculative decoding core: prefill, decode, speculative step, generate.

Draft-then-verify (Leviathan et al. 2023; Chen et al. 2023): a proposer drafts k tokens, the
target scores all of them in one forward pass, `llm_engine.verify` keeps the longest acceptable
prefix plus one recovered or bonus token, and both KV caches are rolled back to the committed
tokens. The API is step-level so that a scheduler thread can step every request in turn (`step`) or
all of them at once, their rows in one target forward (`step_many`); each `RequestState` owns its
caches, generator, proposer and statistics.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from llm_engine import cost_model as costs
from llm_engine import kv, methods
from llm_engine.adaptive import CostGate, DraftLength, PlainStepCost
from llm_engine.config import EngineConfig, GrammarSpec, SamplingConfig
from llm_engine.grammar import GrammarCache, GrammarState
from llm_engine.prefixes import SharedPrefixes
from llm_engine.proposers import (
    EMPTY_DRAFT,
    Draft,
    ProposeContext,
    Proposer,
    make_proposer,
)
from llm_engine.runner import EagerRunner, Forward, TargetRunner
from llm_engine.sampling import (
    gumbel_noise,
    is_greedy,
    logits_to_probs,
    make_generator,
    penalize,
)
from llm_engine.stats import EngineTotals, FinishReason, RequestStats, StepStats
from llm_engine.verify import (
    VerifyResult,
    clip_committed,
    mask_logits,
    verify_greedy,
    verify_gumbel,
    verify_sampling,
)

log = logging.getLogger(__name__)
_NO_TOKENS = torch.empty(0, dtype=torch.long)  # [0], the draft of a plain step
_DROPPED_KEPT = 1024  # dropped session ids remembered (a request outlives its call by a step)


@dataclass(eq=False)
class RequestState:
    prompt_ids: list[int]
    sampling: SamplingConfig
    session_id: str | None
    method: str
    token_ids: list[int]  # committed tokens, prompt first; the target cache holds all but the last
    cache: DynamicCache | None
    draft_length: DraftLength
    gate: CostGate
    stats: RequestStats
    t_start: float
    # Built at the first step, on the thread that steps requests (`SpeculativeEngine._equip`):
    generator: torch.Generator | None = None  # draws in step order: drafts and verify_sampling
    noise_seed: int = 0  # seeds each position's Gumbel noise for verify_gumbel
    proposer: Proposer | None = None
    grammar: GrammarState | None = None  # a constrained request's matcher (`llm_engine.grammar`)
    reuse_len: int = 0  # prompt tokens whose KV came from the session cache
    prefilled: bool = False
    finished: bool = False
    finish_reason: FinishReason | None = None
    cancelled: bool = False  # set from any thread; honoured at the next step boundary
    cancel_reason: str = "cancelled"  # the finish_reason a cancel ends with: or 'stop', 'error'
    cancel_time: float | None = None
    released: bool = field(default=False, repr=False)

    def cancel(self, reason: str = "cancelled") -> None:
        """End the request at the next step boundary, recorded as `reason`: 'cancelled' when the
        caller gave up, or the serving layer's 'stop' (a stop string) or 'error'."""
        if self.cancel_time is None:  # cancel-to-stop counts from the first cancel
            self.cancel_time = time.perf_counter()
        self.cancel_reason = reason
        self.cancelled = True

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_ids) :]


@dataclass
class _Drafted:
    """A step drafted and not yet verified (`SpeculativeEngine._draft`)."""

    k: int  # the draft length asked for
    draft: Draft
    rows: list[int]  # the target's rows: the last committed token, then the drafts
    budget: int
    first: int  # the target cache's length before the verify
    t_start: float
    t_drafted: float


def _batches(steps: list[tuple[int, RequestState, _Drafted]],
             max_rows: int) -> list[list[tuple[int, RequestState, _Drafted]]]:
    """Drafted steps grouped, in order, into forwards of at most max_rows rows."""
    batches: list[list] = []
    rows = 0
    for item in steps:
        n = len(item[2].rows)
        if not batches or rows + n > max_rows:
            batches.append([])
            rows = 0
        batches[-1].append(item)
        rows += n
    return batches


@dataclass
class _SessionKV:
    cached_tokens: list[int]  # the tokens whose positions the cache holds
    cache: DynamicCache
    proposer: Proposer
    method: str


class SpeculativeEngine:
    def __init__(
        self,
        target_model: torch.nn.Module,
        tokenizer,
        config: EngineConfig,
        draft_model: torch.nn.Module | None = None,
        max_sessions: int = 8,
        eos_token_ids: set[int] | None = None,
        eagle_head: torch.nn.Module | None = None,
        runner: TargetRunner | None = None,
        cost_model: costs.CostModel | None = None,
    ):
        self.target = target_model
        self.runner = runner or EagerRunner(target_model)
        self.tokenizer = tokenizer  # kept for callers; never used on the decode path
        self.config = config
        self.spec = config.speculation
        self.draft_model = draft_model
        self.eagle_head = eagle_head
        # Fail at construction, not at the first request: unknown method, its model missing.
        self._new_proposer(self.spec.method).release()
        self.device = next(target_model.parameters()).device
        self.eos_token_ids = frozenset(
            eos_token_ids if eos_token_ids is not None else _eos_ids(tokenizer, target_model)
        )
        self.max_sessions = max_sessions
        # Prompt prefixes new sessions start from (a system prompt): `llm_engine.prefixes`.
        self.prefixes = SharedPrefixes(self.runner) if self.runner.copies_prefixes else None
        self.shared_forwards = config.shared_forwards  # `step_many`; a benchmark may switch it
        # Measured here when the caller has none (a test's tiny model measures in milliseconds).
        self.cost_model = cost_model or self.measure_costs(repeats=2)
        # One estimate per engine, a machine property: the load-time figure until steps come in.
        self.plain_cost = PlainStepCost(initial_ms=self.cost_model.plain_ms)
        self.totals = EngineTotals()
        self._sessions: OrderedDict[str, _SessionKV] = OrderedDict()
        # Sessions dropped lately: a request of one still in flight frees its KV on release
        # instead of keeping it for a call that has ended.
        self._dropped: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()
        self._grammars: GrammarCache | None = None  # built by the first constrained request
        self._scoring: tuple[list[int], Any] | None = None  # next_logprob's prompt and cache

    # -- request lifecycle -------------------------------------------------------------------

    def start(
        self,
        prompt_ids: list[int],
        sampling: SamplingConfig | None = None,
        session_id: str | None = None,
        method: str | None = None,
    ) -> RequestState:
        """Create a request: checks in plain Python, no torch, so a caller on an event loop may
        call it. The first step() builds the proposer, the generator and the grammar's matcher,
        takes the session's prefix cache and prefills."""
        sampling = sampling or self.config.sampling
        method = method or self.spec.method
        prompt_ids = list(prompt_ids)
        if not prompt_ids:
            raise ValueError("empty prompt")
        if len(prompt_ids) >= self.config.max_context:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens >= max_context")
        methods.check(method)
        setting = methods.model_setting(method)
        if setting is not None and setting not in self._models():
            raise ValueError(f"speculation method {method!r} needs a model in engine.{setting}")
        if sampling.grammar is not None and self.tokenizer is None:
            raise ValueError("a grammar needs the engine's tokenizer")
        spec = self.spec
        # Drafts without q are verified with per-position noise, so their tokens do not depend on
        # the K schedule. A sampling draft model's do: it draws from the generator in step order,
        # and a timing-driven gate would make a seeded request's tokens vary between runs.
        samples = methods.innermost(method).samples_drafts
        timing_free = not is_greedy(sampling) and sampling.seed is not None and samples
        return RequestState(
            prompt_ids=prompt_ids,
            sampling=sampling,
            session_id=session_id,
            method=method,
            token_ids=list(prompt_ids),
            cache=None,
            # A combined method ("grammar+draft") costs what its model proposer costs.
            draft_length=DraftLength(
                self.cost_model, method.rpartition("+")[2], spec.num_draft_tokens,
                spec.min_draft_tokens, spec.max_draft_tokens, spec.adaptive,
            ),
            gate=CostGate(
                self.plain_cost,
                enabled=spec.gate,
                measured=not timing_free,
                min_steps=spec.gate_min_steps,
                reprobe_steps=spec.gate_reprobe_steps,
                probe_k=spec.gate_probe_draft_tokens,
            ),
            stats=RequestStats(method=method, prompt_tokens=len(prompt_ids)),
            t_start=time.perf_counter(),
        )

    def _equip(self, state: RequestState) -> None:
        """What start() leaves to the first step: the proposer, the generator (the seed itself
        when there is one; else a fresh random one) and a constrained request's matcher."""
        state.proposer = self._new_proposer(state.method)
        state.grammar = self._grammar_state(state.sampling)
        state.generator = make_generator(state.sampling.seed, self.device)
        state.noise_seed = state.generator.initial_seed()

    def step(self, state: RequestState) -> list[int]:
        """Advance one step and return the newly committed token ids (EOS included, if hit)."""
        if state.finished:
            return []
        if state.cancelled:
            self._finish(state, "cancelled")
            return []
        budget = self._budget(state)
        if budget <= 0:
            self._finish(state, "length")
            return []
        with torch.inference_mode():
            if not state.prefilled:
                if state.cache is None:
                    self._bind_session(state)
                return self._prefill(state, budget)
            return self._speculative_step(state, budget)

    def step_many(self, states: list[RequestState]) -> list[list[int] | Exception]:
        """One step for each request, as `step` would take it, with the decode and verify rows of
        several requests in one target forward where the runner shares forwards
        (`TargetRunner.shared_rows`): each request keeps its own cache, proposer, sampling and
        stats, and its tokens are the ones it would get alone. A prefill chunk runs alone.

        Returns each request's new tokens, or the exception its step raised: one request's
        failure is its own (a shared forward that fails is run again request by request). Each
        request of a shared forward records the whole forward's time as its verify time: what
        it waited, which is what its cost gate weighs."""
        results: dict[int, list[int] | Exception] = {}
        drafted: list[tuple[int, RequestState, _Drafted]] = []
        shares = self.shared_forwards and self.runner.shared_rows > 0
        with torch.inference_mode():
            for j, state in enumerate(states):
                try:
                    budget = self._budget(state)
                    if shares and state.prefilled and not state.finished \
                            and not state.cancelled and budget > 0:
                        drafted.append((j, state, self._draft(state, budget)))
                    else:
                        results[j] = self.step(state)
                except Exception as exc:
                    results[j] = exc
            for batch in _batches(drafted, self.runner.shared_rows):
                t0 = time.perf_counter()
                try:
                    outs = [self._verify_forward(batch[0][1], batch[0][2])] if len(batch) == 1 \
                        else self.runner.forward_many(
                            [(state.cache, torch.tensor([step.rows], device=self.device))
                             for _, state, step in batch])
                except Exception as exc:
                    if len(batch) == 1:
                        results[batch[0][0]] = exc
                        continue
                    # Which request broke it? Each runs alone: only that one fails.
                    log.warning("a shared forward failed: its requests run alone", exc_info=exc)
                    outs = [None] * len(batch)
                verify_s = time.perf_counter() - t0
                for (j, state, step), out in zip(batch, outs, strict=True):
                    try:
                        if out is None:
                            t1 = time.perf_counter()
                            out = self._verify_forward(state, step)
                            verify_s = time.perf_counter() - t1
                        results[j] = self._settle(state, step, out, verify_s)
                    except Exception as exc:
                        results[j] = exc
        return [results[j] for j in range(len(states))]

    def release(self, state: RequestState) -> None:
        """Free the request's KV, or keep it as its session's prefix cache."""
        if state.released:
            return
        state.released = True
        if not state.finished:
            self._finish(state, "cancelled")
        with self._lock:
            dropped = state.session_id in self._dropped
        if state.session_id is not None and state.cache is not None and not dropped:
            cached = state.token_ids[: self.runner.length(state.cache)]
            self._keep_session(
                state.session_id, _SessionKV(cached, state.cache, state.proposer, state.method)
            )
        elif state.proposer is not None:  # None: it never took a step
            state.proposer.release()
        state.cache = None

    def generate(
        self,
        prompt_ids: list[int],
        sampling: SamplingConfig | None = None,
        session_id: str | None = None,
    ) -> Iterator[list[int]]:
        """Yield the tokens of each step until the request finishes. For stats, use start/step."""
        state = self.start(prompt_ids, sampling, session_id)
        try:
            while not state.finished:
                tokens = self.step(state)
                if tokens:
                    yield tokens
        finally:
            self.release(state)

    @torch.inference_mode()
    def next_logprob(self, prompt_ids: list[int], token_ids: Collection[int]) -> float:
        """log p(the next token is one of token_ids | prompt_ids) under the target: a
        classifier's question, not a request. One forward on a cache of its own, which keeps the
        last scored prompt, so that only what differs from it runs (a caller's growing words, or
        questions that share a template, cost their new tokens)."""
        if not prompt_ids or len(prompt_ids) > self.config.max_context:
            raise ValueError(f"a prompt of {len(prompt_ids)} tokens cannot be scored")
        if not token_ids:
            raise ValueError("no token to score")
        scored, cache = self._scoring or ([], self.runner.new_cache())
        self._scoring = None  # until this forward has left the cache whole
        keep = min(kv.common_prefix_len(scored, prompt_ids), len(prompt_ids) - 1)
        self.runner.crop(cache, keep)
        out = self.runner.forward(cache, torch.tensor([prompt_ids[keep:]], device=self.device),
                                  last_only=True)
        self._scoring = (list(prompt_ids), cache)
        logprobs = out.logits[-1].float().log_softmax(-1)
        return float(logprobs[sorted(set(token_ids))].logsumexp(0))

    # -- the ladder: prefill, decode, speculative step -----------------------------------------

    def _prefill(self, state: RequestState, budget: int) -> list[int]:
        """Run the prompt (or its new suffix) through the target, one chunk per step, so that a
        long prompt neither delays a cancel nor stalls other requests; the last chunk commits the
        first token."""
        t0 = time.perf_counter()
        first = self.runner.length(state.cache)
        chunk = state.token_ids[first : first + self.config.prefill_chunk]
        last = first + len(chunk) == len(state.token_ids)
        out = self.runner.forward(state.cache, torch.tensor([chunk], device=self.device),
                                  last_only=True)  # logits [1, vocab]
        stats = state.stats
        stats.prefill_ms += (time.perf_counter() - t0) * 1000.0
        stats.prefill_tokens += len(chunk)
        stats.reused_prefix_tokens = state.reuse_len
        if not last:
            self._observe_target(state, state.token_ids[: first + len(chunk) + 1], out.hidden)
            return []
        state.prefilled = True
        result = self._verify(state, EMPTY_DRAFT, out.logits)
        return self._commit(state, result.tokens, budget, first, out.hidden)

    def _speculative_step(self, state: RequestState, budget: int) -> list[int]:
        """Draft k tokens, verify them in one target forward, commit, roll back. k = 0 decodes."""
        step = self._draft(state, budget)
        out = self._verify_forward(state, step)
        return self._settle(state, step, out, time.perf_counter() - step.t_drafted)

    def _verify_forward(self, state: RequestState, step: _Drafted) -> Forward:
        # Where the verify curve says more rows are cheaper (CPU row blocks), pad; the padding's
        # logits are never read and its KV is cropped with the rejected drafts'.
        rows = step.rows + step.rows[-1:] * (self.cost_model.rows(len(step.rows)) - len(step.rows))
        return self.runner.forward(state.cache, torch.tensor([rows], device=self.device))

    def _draft(self, state: RequestState, budget: int) -> _Drafted:
        # The bonus token means k drafts can commit k + 1 tokens: never draft past the budget.
        k = min(state.gate.limit(state.draft_length.k), self.spec.max_draft_tokens, budget - 1)
        t0 = time.perf_counter()
        draft = EMPTY_DRAFT
        if k > 0:
            ctx = ProposeContext(state.token_ids, k, state.sampling, state.generator,
                                 state.grammar, self.eos_token_ids)
            draft = state.proposer.propose(ctx)
            if state.grammar is not None:  # the masks end where the grammar refuses a draft
                draft = draft.head(state.grammar.constrain(draft.tokens))
        return _Drafted(k, draft, [state.token_ids[-1], *draft.tokens], budget,
                        self.runner.length(state.cache), t0, time.perf_counter())

    def _settle(self, state: RequestState, step: _Drafted, out: Forward,
                verify_s: float) -> list[int]:
        """Verify a drafted step's rows (`out`, the target's forward over them), commit, record."""
        draft = step.draft
        result = self._verify(state, draft, out.logits[: len(step.rows)])  # [k + 1, vocab]
        drafted = len(draft.tokens)
        if drafted:
            state.proposer.update(result.num_accepted)
        state.draft_length.observe(drafted, result.num_accepted)
        draft_s = step.t_drafted - step.t_start
        # The prediction only matters for a step that drafted: spare plain steps its search.
        state.gate.observe(drafted, len(result.tokens), (draft_s + verify_s) * 1000.0,
                           pays=not drafted or state.draft_length.pays)
        stats = StepStats(
            k=step.k,
            drafted=drafted,
            accepted=result.num_accepted,
            rejection_pos=result.rejection_pos,
            committed=0,
            grammar_drafted=draft.forced,
            draft_ms=draft_s * 1000.0,
            verify_ms=verify_s * 1000.0,
        )
        state.stats.record_step(stats)
        new = self._commit(state, result.tokens, step.budget, step.first, out.hidden)
        stats.committed = len(new)
        return new

    def _observe_target(self, state: RequestState, token_ids: list[int],
                        hidden: torch.Tensor) -> None:
        if state.proposer.uses_target_hidden:
            state.proposer.observe_target(token_ids, hidden)

    def _verify(self, state: RequestState, draft: Draft, logits: torch.Tensor) -> VerifyResult:
        # logits: [k + 1, vocab]
        if state.grammar is None:
            return self._verify_rows(state, draft, self._penalize(state, draft, logits))
        # Each row masked by its position's grammar state (module doc of llm_engine.grammar).
        masks = state.grammar.masks().to(logits.device)  # [k + 1, vocab]
        masked = self._penalize(state, draft, mask_logits(logits, masks))
        result = self._verify_rows(state, draft, masked)
        state.grammar.commit(result.num_accepted, result.tokens)
        return result

    def _penalize(self, state: RequestState, draft: Draft, logits: torch.Tensor) -> torch.Tensor:
        """Row i penalised with the committed tokens and drafts d_0..d_{i-1}, the history plain
        decoding would have there; model drafts are penalised alike (`proposers.base`)."""
        return penalize(logits, state.token_ids, draft.tokens, state.sampling, self.eos_token_ids)

    def _verify_rows(self, state: RequestState, draft: Draft,
                     logits: torch.Tensor) -> VerifyResult:
        # logits: [k + 1, vocab], masked and penalised
        draft_tokens = torch.tensor(draft.tokens, dtype=torch.long) if draft.tokens else _NO_TOKENS
        if is_greedy(state.sampling):
            return verify_greedy(draft_tokens, logits)
        p = logits_to_probs(logits, state.sampling)  # [k + 1, vocab]
        if draft.q is None:
            # Row 0 chooses the token at index len(token_ids): position-coupled noise makes the
            # tokens independent of how the request was cut into steps (verify module doc).
            first, (rows, vocab) = len(state.token_ids), p.shape
            noise = gumbel_noise(state.noise_seed, first, rows, vocab, p.device)  # [k + 1, vocab]
            return verify_gumbel(draft_tokens, p, noise)
        q = _align_vocab(draft.q.to(p.device), p.shape[-1])  # [k, vocab]
        return verify_sampling(draft_tokens, q, p, state.generator)

    def _commit(self, state: RequestState, tokens: list[int], budget: int, first: int,
                hidden: torch.Tensor) -> list[int]:
        """Append verified tokens (cut at EOS or the budget) and roll the target cache back.

        `first` is the cache length before the forward whose hidden states [rows, hidden] these
        are: row i belongs to position first + i.
        """
        tokens, reason = clip_committed(tokens, self._ends(state), budget)
        state.token_ids.extend(tokens)
        # Drop the KV of rejected drafts (and of anything after an EOS): the cache holds exactly
        # the committed tokens but the last, which the next step feeds.
        self.runner.crop(state.cache, len(state.token_ids) - 1)
        # The features of the positions that stayed in the cache.
        self._observe_target(state, state.token_ids,
                             hidden[: self.runner.length(state.cache) - first])
        now_ms = (time.perf_counter() - state.t_start) * 1000.0
        state.stats.record_tokens(len(tokens), now_ms)
        if reason is not None:
            self._finish(state, reason)
        return tokens

    def _ends(self, state: RequestState) -> frozenset[int]:
        """The tokens that finish the request: EOS, or none with `ignore_eos`."""
        return frozenset() if state.sampling.ignore_eos else self.eos_token_ids

    def _budget(self, state: RequestState) -> int:
        generated = len(state.token_ids) - len(state.prompt_ids)
        return min(
            state.sampling.max_new_tokens - generated,
            self.config.max_context - len(state.token_ids),
        )

    def _finish(self, state: RequestState, reason: str) -> None:
        if reason == "cancelled":  # a cancel says why: a stop string is no caller giving up
            reason = state.cancel_reason
        state.finished = True
        state.finish_reason = reason
        stats = state.stats
        now = time.perf_counter()
        stats.finish_reason = reason
        stats.total_ms = (now - state.t_start) * 1000.0
        stats.gated_off = state.gate.closed_count > 0
        if reason == "cancelled" and state.cancel_time is not None:
            stats.cancel_to_stop_ms = (now - state.cancel_time) * 1000.0
        with self._lock:
            self.totals.add(stats)

    # -- prefix reuse between turns of one session ----------------------------------------------

    def _bind_session(self, state: RequestState) -> None:
        """Give the request its session's cache (cropped to the shared prefix) or a fresh one.

        Done at the first step, on the thread that steps requests, not in start(): a request
        cancelled just before this one was submitted (an early reply discarded because the caller
        went on) has released its cache by then, so its prefix is reused, not prefilled again.
        """
        self._equip(state)
        cache, proposer, state.reuse_len = self._take_session(
            state.session_id, state.prompt_ids, state.method, state.proposer)
        state.cache, state.proposer = cache, proposer
        proposer.begin(state.prompt_ids)

    def _take_session(
        self, session_id: str | None, prompt_ids: list[int], method: str, fresh: Proposer
    ) -> tuple[DynamicCache, Proposer, int]:
        """The session's cache cropped to the prompt's shared prefix, or a new cache with the
        `fresh` proposer."""
        entry = None
        if session_id is not None:
            with self._lock:
                entry = self._sessions.pop(session_id, None)
        if entry is None:
            if self.prefixes is not None and not fresh.uses_target_hidden:
                # An EAGLE head never saw a copied prefix's hidden states: it prefills them all.
                cache, keep = self.prefixes.start(prompt_ids)
                if cache is not None:
                    return cache, fresh, keep
            return self.runner.new_cache(), fresh, 0
        # Keep at least one prompt token to feed: its logits give the first new token.
        keep = min(kv.common_prefix_len(entry.cached_tokens, prompt_ids), len(prompt_ids) - 1)
        proposer = entry.proposer
        if entry.method == method:
            fresh.release()
        else:
            proposer.release()
            proposer = fresh
            if proposer.uses_target_hidden:
                keep = 0  # it never saw the cached positions' hidden states: prefill them all
        self.runner.crop(entry.cache, keep)
        return entry.cache, proposer, keep

    def keep_prefix(self, prompt_ids: list[int]) -> None:
        """Prefill `prompt_ids` once, in the chunks a request's prefill uses, and keep their KV
        for every new session whose prompt shares a long enough prefix with them (a system
        prompt and tools: `llm_engine.prefixes`; a request with an EAGLE head prefills its own).
        Only prefixes kept so are shared: every session then starts from the same numbers,
        whichever request came first."""
        if self.prefixes is None:
            return
        with torch.inference_mode():
            cache = self.runner.new_cache()
            for first in range(0, len(prompt_ids), self.config.prefill_chunk):
                chunk = prompt_ids[first:first + self.config.prefill_chunk]
                self.runner.forward(cache, torch.tensor([chunk], device=self.device),
                                    last_only=True)
            self.prefixes.keep(prompt_ids, cache)

    def measure_costs(self, repeats: int = 5, context: int = 256,
                      key: dict | None = None) -> costs.CostModel:
        """Time the target's forward for 1 .. max_draft_tokens + 1 rows and each available
        proposer's drafting on this machine (`llm_engine.cost_model`)."""
        models = self._models()
        available = [m for m in methods.names()
                     if m != "off" and methods.model_settings().get(m, "") in {"", *models}]
        context = max(min(context, self.config.max_context - 2 * self.spec.max_draft_tokens - 8), 8)
        return costs.measure(
            self.runner, self.spec.max_draft_tokens + 1,
            {m: (lambda m=m: self._new_proposer(m)) for m in available}, context, repeats, key)

    def _new_proposer(self, method: str) -> Proposer:
        return make_proposer(method, self.spec, self._models().get(methods.model_setting(method)))

    def compile_grammars(self, specs: list[GrammarSpec]) -> None:
        """Compile grammars ahead of the requests that use them: a request starts on its caller's
        thread (an event loop), and a tool list's first compile takes a few hundred ms. The cache
        keeps them all: it grows to hold these with room for others."""
        cache = self._grammar_cache()
        cache.size = max(cache.size, 2 * len(specs))
        for spec in specs:
            cache.compile(spec)

    def compiled_grammars(self) -> int:
        """How many grammars are compiled and kept."""
        return len(self._grammars) if self._grammars is not None else 0

    def _grammar_cache(self) -> GrammarCache:
        if self._grammars is None:
            if self.tokenizer is None:
                raise ValueError("a grammar needs the engine's tokenizer")
            vocab = self.target.get_output_embeddings().weight.shape[0]  # the logits' width
            self._grammars = GrammarCache(self.tokenizer, vocab, self.eos_token_ids)
        return self._grammars

    def _grammar_state(self, sampling: SamplingConfig) -> GrammarState | None:
        if sampling.grammar is None:
            return None
        return self._grammar_cache().new_state(sampling.grammar, self.spec.max_draft_tokens + 1)

    def _models(self) -> dict[str, torch.nn.Module]:
        """The drafting models loaded, by the engine setting that names them."""
        models = {"draft": self.draft_model, "eagle": self.eagle_head}
        return {setting: model for setting, model in models.items() if model is not None}

    def _keep_session(self, session_id: str, entry: _SessionKV) -> None:
        with self._lock:
            old = self._sessions.pop(session_id, None)
            self._sessions[session_id] = entry
            evicted = [old] if old is not None else []
            while len(self._sessions) > self.max_sessions:
                evicted.append(self._sessions.popitem(last=False)[1])
        for stale in evicted:
            stale.proposer.release()

    @property
    def sessions_kept(self) -> int:
        """Sessions whose KV is kept as a prefix cache (a finished call keeps none)."""
        return len(self._sessions)

    def drop_session(self, session_id: str) -> None:
        """Forget a session's prefix cache (the call ended; its id is not used again). A request
        of it still in flight frees its KV when it ends."""
        with self._lock:
            entry = self._sessions.pop(session_id, None)
            self._dropped[session_id] = None
            while len(self._dropped) > _DROPPED_KEPT:
                self._dropped.popitem(last=False)
        if entry is not None:
            entry.proposer.release()


def _eos_ids(tokenizer, model: torch.nn.Module) -> set[int]:
    ids: set[int] = set()
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    generation_config = getattr(model, "generation_config", None)
    eos = getattr(generation_config, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    elif eos is not None:
        ids.update(int(i) for i in eos)
    return ids


def _align_vocab(q: torch.Tensor, vocab: int) -> torch.Tensor:
    # q: [k, draft_vocab] -> [k, vocab]. Checkpoints pad their embeddings differently; the
    # padding ids are never drafted, so zero probability there is exact.
    if q.shape[-1] == vocab:
        return q
    if q.shape[-1] > vocab:
        return q[:, :vocab]
    return F.pad(q, (0, vocab - q.shape[-1]))
