"""Continuous batching under one rule: each step a request gets up to
`num_tokens - num_computed_tokens` new tokens, within the step's token budget and
`max_num_seqs`. Running requests come first, then waiting ones in policy order. Prefill,
chunked prefill, decode and prefix-cache hits all fall out of the rule; one step mixes them.

Admission first matches the request's tokens against the prefix cache: the cached blocks
join its block table and count as computed. After each step every block that filled
enters the cache, so a finished request leaves its prompt and output behind for the next
turn. Policies: fcfs (arrival order), priority (then arrival), lpm (longest cached prefix
first, SGLang's; a request passed over LPM_MAX_PASSED_OVER times goes first, and past
LPM_MAX_QUEUE waiting requests it falls back to arrival order, as SGLang does). A waiting
request whose first uncached block another prefill chunk of the same step computes (the same
tokens after the same cached blocks, one salt) waits for a later step, where it hits that block
in the cache instead of computing it again (SGLang's in-batch prefix deferral): a select's
choices or a batch over one fresh prefix compute the prefix once. Only the first block of each
is compared, and the request that computes it is already in the step, so nobody waits forever.

A request with images (`Request.mm_features`) starts, each step, only the images that fit the
step's encoder budget (encoder_budget.py, `--max-num-encoder-input-tokens`, in placeholder
tokens): its chunk is cut right before the first image past it, and one cut to nothing waits
(a running request is passed over, a waiting one is not admitted, as vLLM's). The first image of
a step always goes; text-only requests never consult it. Gemma 3's image tokens see each other
both ways: a chunk never ends inside an image (encoder_budget.py's `whole_images`).

Out of blocks, the most recently admitted running request (under the "priority"
policy: the lowest-priority one) is preempted by recompute: its blocks are freed and it
goes back to the front of the waiting queue.

A request with n > 1 samples its n first tokens from one prefill, then forks: each
sample shares the prompt's full blocks and gets a copy of the partial last one. A beam
search's beams fork the same way (`fork_beam`, engine/beam_groups.py); a beam whose token is
in while others of its search still compute theirs is `held`: neither scheduled nor preempted.

A model with recurrent layers (Qwen3-Next) resumes a hit from a snapshot of their state where
the hit ends (state_snapshots.py): its hits stop at the last cached block with one, its chunks
are cut where a state should be saved, and each step's plan says which states to restore
before the forward and to save after it. Its forked samples are admitted anew, from the cache.

Speculative decoding (spec_decode/): a decoding request with drafts gets them as extra tokens
of its chunk, from what the step leaves of the budget and the free blocks once every request
has its own tokens (`_add_drafts`: a draft never delays or preempts anyone), within max_tokens
and max_model_len. Its update keeps the run of tokens its rows agree with and rolls back the
KV of the rest: they stop counting as computed and the blocks past the kept tokens go back
(`_accept_drafts`); only known tokens ever enter the prefix cache, so no draft does. Such a
step is always synchronous (its update decides how many tokens it keeps), and so is one whose
requests are then asked for drafts (the engine core's `_drafts_need_tokens`); a chunk whose
last token is pending never takes drafts (any the request holds followed an earlier token).

A step's life: `schedule()` plans it, `mark_launched(plan)` counts its tokens as computed once
the runner has queued it (each token it samples is a placeholder, `num_pending_tokens`),
`update(plan, sampled)` puts the sampled ids in their place and applies the stop rules.
With async scheduling the next `schedule()` runs between the two, while the device
computes: a request whose last token is pending gets it as its one new token (the runner
takes its id on the device). Then:
- a request sure to finish on its pending token (max_tokens, max_model_len) is not
  scheduled again, and its seat goes to a waiting request (its blocks come back at the
  update);
- a request that leaves (finished or aborted) while a launched step still computes for
  it gives its blocks back only when the last launched step is updated;
- no request is preempted while a step is in flight: a step short of blocks schedules
  the running requests that fit and sets `short_of_blocks`; the engine then collects
  before the next schedule, which may preempt;
- blocks enter the prefix cache when the step that fills them is launched (or their last
  token becomes known), so each schedule sees the cache (and the cache's copies of
  duplicate blocks) that the synchronous engine's schedule of the same step sees.

With a sliding window on every layer (`sliding_window`, the largest of them; see
sliding_window.py) a request gives back the blocks no query of it can see again; its
block table keeps their places, pointing at the pool's null block. Such a block goes:
- when the step whose queries come after it is updated: a step still in flight starts
  where the updated one ended, so it never sees the block (with async scheduling blocks
  go back one step later than in the synchronous loop, never earlier);
- only once the prefix cache has it: a cached block becomes evictable, not lost, and a
  request that hits the prefix later takes the hit as far as its window's blocks are all
  still there (the blocks before that window it does not take at all);
- so a request's need for new blocks counts its table's entries, held or given back, and
  a long request runs in about its window's blocks: a chunk is cut so that its blocks,
  from the first one its queries see, fit the whole pool, and `check_request` asks only
  for the most blocks a request holds at once.
With a global layer among the windowed ones, `FullContextBlocks` (the null object) keeps
every block and none of this changes anything.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from ember.config import EngineConfig
from ember.request import Request, RequestStatus
from ember.scheduler.block_pool import BlockPool
from ember.scheduler.encoder_budget import EncoderBudget
from ember.scheduler.host_tier import HostKVTier, block_hashes
from ember.scheduler.prefix_cache import NullPrefixCache, PrefixCache
from ember.scheduler.sliding_window import FullContextBlocks, make_window_blocks
from ember.scheduler.state_snapshots import NoStateSnapshots
from ember.scheduler.swap_space import SWAP_MIN_TOKENS, SwapSpace

LPM_MAX_PASSED_OVER = 32
LPM_MAX_QUEUE = 128  # a longer queue is taken in arrival order: lpm looks up every waiting request
EVICT_AHEAD_DIVISOR = 32  # with a copy stream, the host tier's evictions keep 1/32 of the pool free (see _evict_ahead)


@dataclass
class ScheduledChunk:
    request: Request
    num_new_tokens: int  # drafts included
    # speculative decoding: the drafts this decode chunk verifies, its last num_new_tokens - 1
    # tokens; each of its rows samples (spec_decode/__init__.py)
    draft_token_ids: list[int] = field(default_factory=list)
    # True when this chunk reaches the end of the request's tokens: a token is sampled.
    # Fixed when the chunk is made: mark_launched() advances the counters it is read from.
    samples: bool = field(init=False)
    start: int = field(init=False)  # the position of its first token

    def __post_init__(self) -> None:
        self.start = self.request.num_computed_tokens
        self.samples = self.start + self.num_new_tokens - len(self.draft_token_ids) == self.request.num_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst), before the forward
    # recurrent states (state_snapshots.py): (request id, snapshot) its new state slot starts from,
    # before the forward; (request id, snapshot) its state is saved into, after the forward
    state_restores: list[tuple[str, int]] = field(default_factory=list)
    state_saves: list[tuple[str, int]] = field(default_factory=list)
    short_of_blocks: bool = False  # running requests left out rather than preempt during a step in flight
    # the host tier (host_tier.py): (device block, host slot) evicted blocks to keep, before the forward,
    # then (host slot, device block) kept blocks a request's prefix hit takes back
    kv_offloads: list[tuple[int, int]] = field(default_factory=list)
    kv_onloads: list[tuple[int, int]] = field(default_factory=list)
    # with a copy stream (`Scheduler.copy_stream`): (device block, host slot) of blocks evicted ahead of
    # need, held until this step is collected (in free_when_collected), so their copies wait for nothing
    kv_offloads_held: list[tuple[int, int]] = field(default_factory=list)
    # its copies in are for requests that it does not run yet (they run from the next step on): its
    # forward does not wait for them
    loads_ahead: bool = False
    # preemption by swap (swap_space.py): (device block, slot) of the requests it preempts, (slot,
    # device block) of those it resumes. A swapped-out request's blocks are held until this step is
    # collected (in free_when_collected), so their copies wait for nothing; `blocks_swapping_out` of
    # them come back to the pool then, and a request short of blocks that they cover waits for them
    swap_outs: list[tuple[int, int]] = field(default_factory=list)
    swap_ins: list[tuple[int, int]] = field(default_factory=list)
    blocks_swapping_out: int = 0
    launched: bool = False
    free_when_collected: list[int] = field(default_factory=list)  # blocks of requests that left meanwhile

    @property
    def num_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks

    @property
    def has_copies(self) -> bool:
        """Copies that no later plan makes: a step with them is launched even without chunks (one
        whose running requests all wait for the blocks its swap-outs give back)."""
        return bool(self.swap_outs or self.kv_offloads or self.block_copies)

    @property
    def verifies_drafts(self) -> bool:
        """Speculative decoding's step of decode chunks alone, some with drafts: a token each
        and its drafts (the runner runs it as decode rows)."""
        return any(c.draft_token_ids for c in self.chunks) and all(
            c.num_new_tokens == 1 + len(c.draft_token_ids) for c in self.chunks)


class Scheduler:
    def __init__(self, block_pool: BlockPool, config: EngineConfig, prefix_cache: PrefixCache | None = None,
                 sliding_window: int | None = None, state_snapshots: NoStateSnapshots | None = None,
                 host_tier: HostKVTier | None = None, swap_space: SwapSpace | None = None,
                 copy_stream: bool = False) -> None:
        """`config`: the block size, seats, token budget, max_model_len, policy and (the CPU's)
        `attention_parity_len`: shrink prefill chunks deep in a long context, see `_chunk`.
        `sliding_window`: the largest window when every layer has one
        (`sliding_window.shared_window`), else None. `state_snapshots`: a model with recurrent
        layers' snapshots of their state (state_snapshots.py), which its prefix-cache hits need.
        `host_tier`: where the prefix cache's evicted blocks are kept (host_tier.py).
        `swap_space`: where preempted requests' blocks go with preemption_mode swap / auto.
        `copy_stream`: the runner copies KV to and from host memory beside the steps (CUDA's copy
        stream, runner/kv_copies.py): a request whose blocks load runs from the next step on
        when others run in this one (`_load_ahead`), and the host tier's evictions run ahead of
        need (`_evict_ahead`)."""
        self.policy = config.scheduling_policy  # one of EngineConfig's (fcfs, priority, lpm)
        self.pool = block_pool
        self.prefix_cache = prefix_cache or NullPrefixCache()
        self.snapshots = state_snapshots or NoStateSnapshots()
        self.prefix_cache.on_evict = self.snapshots.evicted  # a snapshot goes with its block
        self.host = host_tier
        self.swap = swap_space
        self.preemption_mode = config.preemption_mode
        self.num_swapped = 0  # preemptions by swap (the rest recomputed)
        self.copy_stream = copy_stream
        if host_tier is not None:
            self.prefix_cache.host = host_tier
        self.block_size = config.block_size
        self.window = make_window_blocks(config.block_size, sliding_window)
        self.null_block = block_pool.null_block
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = config.max_model_len
        self.attention_parity_len = config.attention_parity_len
        # images (encoder_budget.py): only a request with images ever consults it
        vision = config.model_config.vision if config.model_config is not None else None
        self.encoder_budget = EncoderBudget(config.max_num_encoder_input_tokens or config.max_num_batched_tokens,
                                            whole_images=vision is not None and vision.bidirectional_images)
        # an encoder's prompt runs in one step (its attention sees the whole prompt at once)
        self.whole_prompts = config.model_config is not None and config.model_config.bidirectional
        # a model with recurrent layers (runner/recurrent_state.py): a running request keeps its
        # seat (and state slot) until it leaves, even when it ends on its pending token, and a
        # forked sample is admitted anew (a state is not shared as blocks are: its prompt comes
        # from the prefix cache's snapshot, where there is one)
        self.hold_seats = config.model_config is not None and config.model_config.linear_layers is not None
        # a hit may end inside a block, copied from the cache's (prefix_cache.py): not where a window
        # releases blocks, a state is kept at block ends only, or a drafter's cache may lag its last tokens
        self.partial_hits = (sliding_window is None and state_snapshots is None and not self.whole_prompts
                             and config.speculative_config is None)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.host_hit_tokens = 0  # prompt tokens the host tier gave back at admission
        self.prefix_cache_queries = 0  # tokens looked up at admission
        self.prefix_cache_hits = 0  # of those, tokens found cached
        self.spec = SpecDecodeCounts()  # speculative decoding's drafts and acceptance, since start
        self._pending_copies: list[tuple[int, int]] = []
        self.in_flight: deque[SchedulerOutput] = deque()  # launched, not yet updated, oldest first

    # -- admission ------------------------------------------------------------------------

    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        self.check_request(req)
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def check_request(self, req: Request) -> None:
        """Refuse a request this engine can never serve (ValueError). Reads only fixed sizes,
        so any thread may call it: the async front checks here before the engine loop sees it."""
        check_request_fits(req, self.max_num_seqs, self.max_model_len, self.window, self.pool.num_blocks)
        if self.whole_prompts and req.num_prompt_tokens > self.max_num_batched_tokens:
            raise ValueError(f"the prompt has {req.num_prompt_tokens} tokens, and an encoder model runs a prompt in "
                             f"one step of at most max_num_batched_tokens={self.max_num_batched_tokens}: shorten it "
                             "or raise max_num_batched_tokens")

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- one step -------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        plan = SchedulerOutput(block_copies=self._pending_copies)
        self._pending_copies = []
        if self.host is not None:
            self.host.new_plan()
        if self.swap is not None:
            self.swap.new_plan()
        budget = self.max_num_batched_tokens
        self.encoder_budget.new_step()
        for req in self._by_policy(self.running):
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING or req.held:
                continue  # preempted earlier in this loop, or a beam waiting for its group
            if req.num_pending_tokens and self._ends_on_pending_token(req):
                continue
            n, images = self._chunk(req, budget), None
            if req.mm_features:
                n, images = self.encoder_budget.cut(req, n, admitted=False, budget=budget)
                if n == 0:
                    continue  # its next image waits for the next step's encoder budget
            if not self._reserve(req, n, plan):
                if plan.short_of_blocks:
                    break
                continue
            self._add_chunk(plan, req, n)
            if images:
                self.encoder_budget.spend(images)
            budget -= n
        # the first block each prefill chunk of this step computes; a waiting request whose first
        # uncached block is one of them waits for it to enter the cache
        computing = {key for c in plan.chunks if c.num_new_tokens > 1
                     and (key := self._block_key(c.request, c.start // self.block_size)) is not None}
        deferred: set[str] = set()
        loading: list[Request] = []  # admitted with blocks to copy in
        seats = self._seats_taken()  # counted once, then per admission (a step may admit hundreds)
        while len(self.waiting) > len(deferred) and budget > 0 and not (plan.preempted or plan.short_of_blocks):
            req = self._next_waiting(deferred)
            if seats + req.num_samples_to_draw > self.max_num_seqs:
                break
            swap_ins = self._swap_in(req) if req.swapped is not None else None
            if swap_ins is None and req.swapped is not None:
                break  # its blocks do not fit yet
            onloads, copy = self._match_prefix(req) if swap_ins is None else ([], None)
            first = self._first_uncached_block(req) if swap_ins is None and not onloads and copy is None else None
            if first is not None:
                if first in computing:  # next step it hits the cache instead of computing the block again
                    self._release_blocks(req)
                    deferred.add(req.request_id)
                    continue
                computing.add(first)
            n, images = self._chunk(req, budget), None
            if req.mm_features:  # n == 0: its first image waits for the next step's encoder budget
                n, images = self.encoder_budget.cut(req, n, admitted=True, budget=budget)
            if (n == 0 or (self.whole_prompts and n < req.num_tokens)  # it waits for a step with room for all of it
                    or self.blocks_for(req.num_computed_tokens + n) - len(req.block_ids) > self.pool.num_available):
                self._release_blocks(req)
                if copy is not None:
                    self.pool.free([copy[0]])
                break
            self._admitted(req)
            if copy is not None:  # the source stays held until the step that copies it is collected
                plan.block_copies.append(copy)
                plan.free_when_collected.append(copy[0])
            if swap_ins or onloads:
                loading.append(req)
            if swap_ins:
                plan.swap_ins += swap_ins
                self.swap.give_back(req.swapped[0])
                req.swapped = None
            if onloads:
                plan.kv_onloads += onloads
                self.host_hit_tokens += len(onloads) * self.block_size
                self.host.num_onloaded += len(onloads)
            self.waiting.remove(req)
            self._grow(req, n)
            req.status = RequestStatus.RUNNING
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
            self.running.append(req)
            seats += req.num_samples_to_draw
            snapshot = self.snapshots.restore(req)
            if snapshot is not None:
                plan.state_restores.append((req.request_id, snapshot))
            self._add_chunk(plan, req, n)
            if images:
                self.encoder_budget.spend(images)
            budget -= n
        if loading and self.copy_stream:
            self._load_ahead(plan, loading)
        if budget > 0 and not plan.preempted:
            self._add_drafts(plan, budget)
        if self.host is not None:
            plan.kv_offloads = self.host.take_offloads()  # those of evictions since the last plan too
            if self.copy_stream and plan.chunks:
                self._evict_ahead(plan)
        return plan

    def _load_ahead(self, plan: SchedulerOutput, loading: list[Request]) -> None:
        """With a copy stream: requests whose blocks this step copies in run from the next step on,
        when others run in this one, so the copies overlap those others' forward instead of
        delaying it (the next step's forward waits for them). They are running already: their
        seats and blocks are theirs, and a later schedule gives them their chunk as it would any
        running request's."""
        ids = {r.request_id for r in loading}
        if all(c.request.request_id in ids for c in plan.chunks):
            return  # nobody else to run meanwhile: this step reads them, after its copies
        plan.chunks = [c for c in plan.chunks if c.request.request_id not in ids]
        plan.state_saves = [s for s in plan.state_saves if s[0] not in ids]
        plan.loads_ahead = True

    def _evict_ahead(self, plan: SchedulerOutput) -> None:
        """With a copy stream and a host tier: once fewer blocks are free than a decode step of the
        running requests may take (one each) or 1/EVICT_AHEAD_DIVISOR of the pool, evict idle cached
        blocks into the tier now, held until this step is collected, so that the next steps'
        allocations find free blocks whose copies are done rather than evict blocks that their own
        forward then has to wait for."""
        want = max(len(self.running), self.pool.num_blocks // EVICT_AHEAD_DIVISOR) - self.pool.num_free
        if want > 0 and self.pool.num_evictable:
            plan.free_when_collected += self.prefix_cache.evict(want, hold=True)
            plan.kv_offloads_held = self.host.take_offloads()

    def _add_drafts(self, plan: SchedulerOutput, budget: int) -> None:
        """Speculative decoding: each decode chunk takes its request's drafts as far as the step's
        leftover budget and free blocks go (after everyone's own tokens: a draft never delays or
        preempts a request), and as far as max_tokens and max_model_len leave room for them all
        and the token after."""
        for i, chunk in enumerate(plan.chunks):
            req = chunk.request
            if budget == 0:
                break
            # a pending last token (async scheduling): its drafts, if any, followed an earlier one
            if not req.draft_token_ids or chunk.num_new_tokens != 1 or not chunk.samples or req.num_pending_tokens:
                continue
            k = min(len(req.draft_token_ids), budget, self.max_model_len - req.num_tokens - 1)
            if req.max_tokens is not None:
                k = min(k, req.max_tokens - len(req.output_token_ids) - 1)
            while k > 0 and self.blocks_for(req.num_tokens + k) - len(req.block_ids) > self.pool.num_available:
                k -= 1
            if k > 0:
                self._grow(req, 1 + k)
                plan.chunks[i] = ScheduledChunk(req, 1 + k, req.draft_token_ids[:k])
                budget -= k

    def reserve_lookahead(self, req: Request, num_slots: int) -> None:
        """Blocks for the KV of the request's next `num_slots` positions, which a drafter writes
        before the step that verifies its drafts (vLLM's lookahead slots), as far as free and
        evictable blocks go: a draft never preempts. The next step's tokens use them; a
        request that leaves gives them back with the rest."""
        need = min(self.blocks_for(min(req.num_computed_tokens + num_slots, self.max_model_len)) - len(req.block_ids),
                   self.pool.num_available)
        if need > 0:
            req.block_ids += self.pool.allocate(need)

    def _add_chunk(self, plan: SchedulerOutput, req: Request, n: int) -> None:
        """Plan `n` tokens of the request; a recurrent state saved where they end on a block boundary."""
        plan.chunks.append(ScheduledChunk(req, n))
        snapshot = self.snapshots.take(req.request_id, req.num_computed_tokens + n)
        if snapshot is not None:
            plan.state_saves.append((req.request_id, snapshot))

    def _chunk(self, req: Request, budget: int) -> int:
        """Tokens the request gets this step: all it lacks, within the budget; with
        `attention_parity_len` L, a chunk starting at context c at most budget * L / (L + c),
        as each of its tokens costs (1 + c / L) times one at context 0. Cut so that its
        blocks, from the first one its queries see, fit the whole pool (only a sliding
        window's request can need more: `check_request` keeps others within the pool). With
        recurrent layers, cut where their state can be saved for the prefix cache
        (`StateSnapshots.chunk`)."""
        c = req.num_computed_tokens
        n = min(req.num_tokens - c, budget, (self.window.first_needed(c) + self.pool.num_blocks) * self.block_size - c)
        if self.attention_parity_len is not None and n > 1:
            parity = self.attention_parity_len
            n = min(n, max(1, self.max_num_batched_tokens * parity // (parity + req.num_computed_tokens)))
        return self.snapshots.chunk(req, n)

    def _seats_taken(self) -> int:
        """Running slots, counting the n a not-yet-forked n > 1 request will take; not those
        of requests that end on their pending token (they leave at the update in flight)."""
        return sum(r.num_samples_to_draw for r in self.running
                   if self.hold_seats or not (r.num_pending_tokens and self._ends_on_pending_token(r)))

    def _by_policy(self, requests) -> list[Request]:
        """Who goes first: admission order (fcfs), or priority then arrival."""
        if self.policy == "priority":
            return sorted(requests, key=lambda r: (r.priority, r.arrival_time))
        return list(requests)

    def _next_waiting(self, deferred: set[str]) -> Request:
        """The waiting request to admit next, of those not `deferred` this step."""
        waiting = [r for r in self.waiting if r.request_id not in deferred] if deferred else self.waiting
        if self.policy == "lpm" and len(waiting) <= LPM_MAX_QUEUE:
            tokens = {r.request_id: self.prefix_cache.peek(r.cache_token_ids, r.cache_salt) for r in waiting}
            return min(waiting, key=lambda r: (r.times_passed_over < LPM_MAX_PASSED_OVER,
                                               -tokens[r.request_id], r.arrival_time))
        return self._by_policy(waiting)[0] if self.policy == "priority" else waiting[0]

    def _first_uncached_block(self, req: Request) -> tuple | None:
        """`_block_key` of the first block a request just matched computes, if a later match
        could take that block from the cache (a hit never takes the block of the last token)."""
        index, partial = divmod(req.num_computed_tokens, self.block_size)
        if partial or index >= (req.num_tokens - 1) // self.block_size:
            return None
        return self._block_key(req, index)

    def _block_key(self, req: Request, index: int) -> tuple | None:
        """What names the request's block `index`: (its salt, the block before it, its tokens).
        Two requests with one key compute the same KV there, as the blocks before are the
        prefix cache's. None when that block is not full of known tokens, when the block before
        is a window's null block, or with no prefix cache."""
        if isinstance(self.prefix_cache, NullPrefixCache) or (index + 1) * self.block_size > req.num_known_tokens:
            return None
        parent = req.block_ids[index - 1] if index else None
        if parent == self.null_block:
            return None
        return req.cache_salt, parent, tuple(req.cache_token_ids[index * self.block_size:(index + 1) * self.block_size])

    def _match_prefix(self, req: Request) -> tuple[list[tuple[int, int]], tuple[int, int] | None]:
        """Take the request's longest cached prefix as computed. At least one token is left
        to compute (its logits give the next token); prompt logprobs need every position from
        their start on (the logits before it: a hit ends before that position's predecessor).
        Returns the (host slot, device block) copies of the part the host tier had, and the
        (cached block, own block) copy of a hit that ends inside a block (its source held)."""
        max_tokens = req.num_tokens - 1
        if req.sampling_params.prompt_logprobs is not None:
            max_tokens = min(max_tokens, max(req.sampling_params.prompt_logprobs_start - 1, 0))
        max_blocks = max_tokens // self.block_size
        if max_tokens == 0:
            return [], None
        tokens = req.cache_token_ids
        hit = self.prefix_cache.match(tokens, max_blocks, req.cache_salt).block_ids
        usable = self.snapshots.usable_hit(req, hit, self.window.usable_hit(hit, self.null_block))
        unseen = self.window.first_needed(usable * self.block_size)  # before the next query's window
        for cut in (usable, unseen):  # the request holds whole nodes: blocks unseen .. usable - 1
            if 0 < cut < len(hit):  # (match cut the path after the hit's last block)
                self.prefix_cache.split(tokens, cut, req.cache_salt)
        self.pool.share(hit[unseen:usable])
        req.block_ids = [self.null_block] * unseen + hit[unseen:usable]
        req.num_released_blocks = unseen
        req.num_blocks_in_cache = usable
        req.num_computed_tokens = usable * self.block_size
        onloads = self._host_hit(req, usable, max_blocks) if usable == len(hit) else []
        if onloads or not self.partial_hits or not self.pool.num_available:
            return onloads, None
        found = self.prefix_cache.match_partial(tokens, usable, max_tokens - usable * self.block_size,
                                                req.cache_salt)
        if found is None:
            return [], None
        src, agree = found
        self.pool.share([src])  # not evicted by the allocation below, nor reused before it is copied
        req.block_ids = req.block_ids + self.pool.allocate(1)
        req.num_computed_tokens += agree
        return [], (src, req.block_ids[-1])

    def _host_hit(self, req: Request, usable: int, max_blocks: int) -> list[tuple[int, int]]:
        """The blocks after a device hit of `usable` that the host tier has: taken as computed,
        as (host slot, device block) copies."""
        if self.host is None or usable >= max_blocks:
            return []
        hashes = block_hashes(req.cache_token_ids, self.block_size, max_blocks, req.cache_salt)[usable:]
        slots = self.host.lookup(hashes)[:self.pool.num_available]
        if not slots:
            return []
        blocks = self.pool.allocate(len(slots))  # may evict (and offload) others' idle blocks, never these slots
        req.block_ids = req.block_ids + blocks
        req.num_computed_tokens += len(blocks) * self.block_size
        return list(zip(slots, blocks))

    def _swap_in(self, req: Request) -> list[tuple[int, int]] | None:
        """A request preempted by swap takes blocks for what it had computed, which come back
        from their slots (None: not enough blocks yet)."""
        slots, computed = req.swapped
        if len(slots) > self.pool.num_available:
            return None
        req.block_ids = self.pool.allocate(len(slots))
        req.num_computed_tokens, req.num_blocks_in_cache, req.num_released_blocks = computed, 0, 0
        return list(zip(slots, req.block_ids))

    def _admitted(self, req: Request) -> None:
        self.prefix_cache_queries += req.num_tokens
        self.prefix_cache_hits += req.num_computed_tokens
        if req.num_cached_tokens is None:  # of the prompt: a grammar's forced tokens are output
            req.num_cached_tokens = min(req.num_computed_tokens, req.num_prompt_tokens)
        if self.policy == "lpm":  # the starvation bound only lpm reads
            for other in self.waiting:
                if other.arrival_time < req.arrival_time:
                    other.times_passed_over += 1

    def _release_blocks(self, req: Request, held_by: SchedulerOutput | None = None) -> None:
        """Give back the request's blocks; with `held_by`, once that plan is collected."""
        blocks = req.block_ids[req.num_released_blocks:]
        if held_by is None:
            self.pool.free(blocks)
        else:
            held_by.free_when_collected += blocks
        req.block_ids, req.num_blocks_in_cache, req.num_computed_tokens, req.num_released_blocks = [], 0, 0, 0

    def _release_unseen(self, req: Request, position: int) -> None:
        """Give back the blocks no query at `position` or later can see (sliding window),
        once the prefix cache has them."""
        upto = min(self.window.first_needed(position), req.num_blocks_in_cache)
        if upto > req.num_released_blocks:
            self.prefix_cache.split(req.cache_token_ids, upto, req.cache_salt)
            self.pool.free(req.block_ids[req.num_released_blocks:upto])
            # a new list: the runner rebuilds its table row from a new list (see _table_row)
            req.block_ids = [self.null_block] * upto + req.block_ids[upto:]
            req.num_released_blocks = upto

    def _cache_full_blocks(self, req: Request, num_tokens: int) -> None:
        """Hand the prefix cache the full blocks of the first `num_tokens` tokens (all known)
        that launched steps compute, as soon as the step is launched or the token known: the
        next schedule then sees the cache (and uses the cache's copies of duplicates) as the
        synchronous engine's schedule of that step does. A block's readers are launched
        after the step that writes it."""
        full = min(req.num_computed_tokens, num_tokens) // self.block_size
        if full > req.num_blocks_in_cache:
            new = req.block_ids[req.num_blocks_in_cache:full]
            self.pool.share(new)  # held while the cache may swap in its own copy of some
            blocks = req.block_ids[:full]
            self.prefix_cache.insert(req.cache_token_ids[:full * self.block_size], blocks, req.cache_salt)
            if blocks != req.block_ids[:full]:  # the cache had its own copy of some: use those
                req.block_ids = blocks + req.block_ids[full:]  # a new list, so no stale view of the old one
            self.pool.free([b for b in new if b in blocks])
            self._free_blocks(req, [b for b in new if b not in blocks])  # a launched step may still read them
            req.num_blocks_in_cache = full
            self.snapshots.keyed(req)  # states saved where these blocks end

    def _cache_partial_block(self, req: Request) -> None:
        """A leaving request's last, partly filled block goes to the prefix cache, so a request
        that goes on from its tokens (a chat's next turn) copies it."""
        if not self.partial_hits:
            return
        # its tokens whose KV a launched step writes; not the last known one (a step in flight for
        # a request that ends is not relied on, as in update)
        full, partial = divmod(min(req.num_computed_tokens, req.num_known_tokens - 1), self.block_size)
        if partial and full == req.num_blocks_in_cache and len(req.block_ids) > full:
            self.prefix_cache.insert_partial(req.cache_token_ids[:full * self.block_size + partial],
                                             req.block_ids[:full + 1], req.cache_salt)

    def _victim(self, scheduled: set[str]) -> Request:
        """The last request in policy order that has no tokens in this step yet (nor is a beam
        holding its token for its group: engine/beam_groups.py). Running
        requests are walked in that order, so the victim is never one already planned."""
        return [r for r in self._by_policy(self.running) if r.request_id not in scheduled and not r.held][-1]

    def _reserve(self, req: Request, n: int, plan: SchedulerOutput) -> bool:
        """Make room for `n` more tokens of a running request, preempting the newest running
        requests if needed. False when `req` itself had to be preempted, when a step is
        in flight (no preemption then: `short_of_blocks`), or when the blocks this step swaps
        out cover its need (it runs once they are back: from the next step on)."""
        while (need := self.blocks_for(req.num_computed_tokens + n) - len(req.block_ids)) > self.pool.num_available:
            if self.in_flight:
                plan.short_of_blocks = True
                return False
            if need <= self.pool.num_available + plan.blocks_swapping_out:
                return False  # what this step swaps out covers it: it runs once the copies are collected
            victim = self._victim({c.request.request_id for c in plan.chunks})
            self._preempt(victim, plan)
            plan.preempted.append(victim)
            if victim is req:
                return False
        self._grow(req, n)
        return True

    def _grow(self, req: Request, n: int) -> None:
        need = self.blocks_for(req.num_computed_tokens + n) - len(req.block_ids)
        if need > 0:
            req.block_ids += self.pool.allocate(need)

    def requeue(self, req: Request) -> None:
        """Preempt a running request by recompute, to the back of the waiting queue (a held
        beam making room for the others, engine/beam_groups.py)."""
        assert not req.num_steps_in_flight
        self.running.remove(req)
        self._release_blocks(req)
        self.snapshots.release(req.request_id)
        req.status, req.held = RequestStatus.PREEMPTED, False
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.append(req)

    def _preempt(self, req: Request, plan: SchedulerOutput) -> None:
        assert not req.num_steps_in_flight, "no preemption while a step computes for the request (see _reserve)"
        self.running.remove(req)
        held_by = None
        if self.swap is not None and (self.preemption_mode == "swap" or req.num_computed_tokens >= SWAP_MIN_TOKENS):
            n = self.blocks_for(req.num_computed_tokens)
            slots = self.swap.take(n) if n else None
            if slots is not None:  # its blocks are held until their copies are collected, not handed on in this step
                plan.swap_outs += list(zip(req.block_ids[:n], slots))
                # those only it holds come back to the pool (as free or, cached, evictable blocks)
                plan.blocks_swapping_out += sum(self.pool.ref_counts[b] == 1
                                                for b in req.block_ids[req.num_released_blocks:])
                req.swapped = slots, req.num_computed_tokens
                self.num_swapped += 1
                held_by = plan
        self._release_blocks(req, held_by)
        self.snapshots.release(req.request_id)
        req.draft_token_ids = []
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def mark_launched(self, plan: SchedulerOutput) -> None:
        """The runner has queued this step: its tokens count as computed, each token it
        samples is pending until `update`, and the blocks it fills enter the prefix cache."""
        plan.launched = True
        self.in_flight.append(plan)
        for chunk in plan.chunks:
            req = chunk.request
            req.num_computed_tokens += chunk.num_new_tokens
            req.num_pending_tokens += chunk.samples
            req.num_steps_in_flight += 1
            self._cache_full_blocks(req, req.num_known_tokens)

    def update(self, plan: SchedulerOutput, sampled: dict[str, list[int]]) -> tuple[list[Request], list[Request]]:
        """Apply a launched step's sampled tokens (launching it first if the caller did not:
        a synchronous step): append them, fork n > 1 requests, apply stop rules, cache the
        filled blocks. A request that left while the step ran drops its token. Returns
        (requests that got tokens, incl. new forks; those that finished, their blocks freed
        or, if a later launched step still computes for them, freed when it is collected)."""
        if not plan.launched:
            self.mark_launched(plan)
        assert self.in_flight[0] is plan, "steps are updated in launch order"
        self.in_flight.popleft()
        stepped, finished = [], []
        for chunk in plan.chunks:
            req = chunk.request
            req.num_steps_in_flight -= 1
            req.num_pending_tokens -= chunk.samples
            if req.status.is_finished:
                continue  # finished or aborted while the step ran: its token is dropped
            # steps still in flight or to come query from this chunk's end on (its drafts' end only if kept)
            self._release_unseen(req, chunk.start + chunk.num_new_tokens - len(chunk.draft_token_ids))
            tokens = sampled.get(req.request_id) if chunk.samples else None
            if tokens is None:
                continue  # a prefill chunk that does not reach the end of the prompt
            if req.max_tokens == 0:  # prompt scoring only: the prompt is computed, the sampled token dropped
                self.finish(req, "length")
                stepped.append(req)
                finished.append(req)
                continue
            if chunk.draft_token_ids:
                reason = None
                for token in self._accept_drafts(req, chunk.draft_token_ids, tokens):
                    req.append_token(token)
                    reason = self._stop_reason(req, token)
                    if reason is not None:
                        break
                self._cache_full_blocks(req, req.num_known_tokens - (reason is not None))
                stepped.append(req)
                if reason is not None:
                    self.finish(req, *reason)
                    finished.append(req)
                continue
            req.append_token(tokens[0])
            reason = self._stop_reason(req, tokens[0])
            # its block now known, if a step in flight computes it; not for a request that ends here
            self._cache_full_blocks(req, req.num_known_tokens - (reason is not None))
            forks = [self._fork(req, i, t) for i, t in enumerate(tokens[1:], start=1)]
            for r in [req, *forks]:
                stepped.append(r)
                if r is not req:
                    reason = self._stop_reason(r, r.output_token_ids[-1])
                if reason is not None:
                    self.finish(r, *reason)
                    finished.append(r)
        self.pool.free(plan.free_when_collected)
        return stepped, finished

    def _accept_drafts(self, req: Request, drafts: list[int], tokens: list[int]) -> list[int]:
        """The tokens a verifying step keeps: its rows' tokens up to the first that differs from
        its draft, that one included (`tokens` has one a row: len(drafts) + 1). The KV of the
        rejected drafts is rolled back: they no longer count as computed, and the blocks past
        the kept tokens go back to the pool (never cached: the cache takes known tokens only)."""
        accepted = 0
        while accepted < len(drafts) and tokens[accepted] == drafts[accepted]:
            accepted += 1
        self.spec.record(len(drafts), accepted)
        req.num_computed_tokens -= len(drafts) - accepted
        keep = max(self.blocks_for(req.num_computed_tokens), req.num_released_blocks)
        if keep < len(req.block_ids):
            self._free_blocks(req, req.block_ids[keep:])
            req.block_ids = req.block_ids[:keep]  # a new list: the runner rebuilds its table row
        return tokens[:accepted + 1]

    def _ends_on_pending_token(self, req: Request) -> bool:
        """Whether the pending token ends the request by length: no step after it is needed."""
        max_tokens = req.sampling_params.max_tokens
        return (max_tokens is not None and len(req.output_token_ids) + req.num_pending_tokens >= max_tokens) \
            or req.num_tokens >= self.max_model_len

    def _fork(self, parent: Request, index: int, token: int) -> Request:
        return self._place_fork(parent, parent.fork(index, token))

    def fork_beam(self, parent: Request, request_id: str, token: int) -> Request:
        """A new beam of `parent`'s search (Request.beam_fork), running beside it on its blocks."""
        return self._place_fork(parent, parent.beam_fork(request_id, token))

    def _place_fork(self, parent: Request, child: Request) -> Request:
        """Give a fork the parent's full blocks (shared) and a copy of its partial one, and a
        running slot; or, with no block free for that copy (or a recurrent state to share), a
        place at the front of the waiting queue, to recompute."""
        full, partial = divmod(parent.num_computed_tokens, self.block_size)
        self.requests[child.request_id] = child
        if self.hold_seats or (partial and not self.pool.num_available):  # (no room for its last block) recompute
            child.num_computed_tokens, child.num_blocks_in_cache, child.status = 0, 0, RequestStatus.WAITING
            self.waiting.appendleft(child)
            return child
        child.block_ids = parent.block_ids[:full]
        child.num_released_blocks = parent.num_released_blocks
        self.pool.share(child.block_ids[child.num_released_blocks:])
        if partial:
            child.block_ids = child.block_ids + self.pool.allocate(1)
            self._pending_copies.append((parent.block_ids[full], child.block_ids[-1]))
        self.running.append(child)
        return child

    def _stop_reason(self, req: Request, token: int) -> tuple[str, int | None] | None:
        params = req.sampling_params
        num_out = len(req.output_token_ids)
        if num_out >= params.min_tokens:
            if not params.ignore_eos and token in req.eos_token_ids:
                return "stop", None
            if token in params.stop_token_ids:
                return "stop", token
        if (params.max_tokens is not None and num_out >= params.max_tokens) or \
                req.num_known_tokens >= self.max_model_len:
            return "length", None
        return None

    # -- leaving --------------------------------------------------------------------------

    def finish(self, req: Request, reason: str, stop_reason: int | str | None = None,
               status: RequestStatus = RequestStatus.FINISHED) -> None:
        """Finish or abort a request: it leaves the queues and holds no block."""
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if status is not RequestStatus.FAILED and req.beam is None:  # (a beam's tail: no one goes on from it)
            self._cache_partial_block(req)
        self._free_blocks(req, req.block_ids[req.num_released_blocks:])
        req.block_ids, req.num_released_blocks = [], 0
        if req.swapped is not None:  # it left while swapped out
            self.swap.give_back(req.swapped[0])
            req.swapped = None
        self.snapshots.release(req.request_id)
        req.finish(reason, stop_reason, status)
        del self.requests[req.request_id]

    def _free_blocks(self, req: Request, block_ids: list[int]) -> None:
        """Drop `req`'s hold on these blocks; while a launched step computes for it, only
        once the last launched step is collected (no block goes back to the pool while a
        launched step may still read or write it)."""
        if req.num_steps_in_flight:
            self.in_flight[-1].free_when_collected += block_ids
        else:
            self.pool.free(block_ids)

    def abort(self, request_id: str, reason: str = "abort",
              status: RequestStatus = RequestStatus.ABORTED) -> list[Request]:
        """Abort (or fail) a request and the samples forked from it; returns those it ended."""
        ended = [r for r in self.requests.values() if r.request_id == request_id
                 or (r.parent is not None and r.parent.request_id == request_id)]
        for req in ended:
            self.finish(req, reason, status=status)
        return ended


@dataclass
class SpecDecodeCounts:
    """Speculative decoding since start, under vLLM's metric names: verifying steps of a request
    (drafts), tokens drafted and accepted, and accepted at each draft position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, drafted: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        if len(self.accepted_per_position) < drafted:
            self.accepted_per_position += [0] * (drafted - len(self.accepted_per_position))
        for i in range(accepted):
            self.accepted_per_position[i] += 1


def check_request_fits(req: Request, max_num_seqs: int, max_model_len: int, window: FullContextBlocks,
                       num_blocks: int) -> None:
    """ValueError for a request that an engine of these sizes can never serve: too many
    samples, a prompt with no room for output, or a sequence whose KV outgrows the whole pool."""
    if req.sampling_params.n > max_num_seqs:
        raise ValueError(f"n={req.sampling_params.n} is more than max_num_seqs={max_num_seqs}: "
                         "lower n or raise max_num_seqs")
    check_prompt_length(req.num_prompt_tokens, max_model_len)
    # the last sampled token never gets KV, so the longest sequence holds one less (and a
    # prompt scored with max_tokens=0 holds the whole prompt)
    max_tokens = max_model_len if req.max_tokens is None else max(req.max_tokens, 1)
    longest = min(req.num_prompt_tokens + max_tokens, max_model_len) - 1
    need = window.most_held(longest)
    if req.beam is not None:
        check_beams_fit(req, max_num_seqs, max_model_len, need, num_blocks)
    if need > num_blocks:
        raise ValueError(
            f"request {req.request_id!r} may grow to {longest + 1} tokens, whose KV needs "
            f"{need} blocks, but the whole pool has {num_blocks}: "
            "lower max_tokens or give the KV cache more memory (num_kv_blocks / kv_cache_memory)"
        )


def check_beams_fit(req: Request, max_num_seqs: int, max_model_len: int, need: int, num_blocks: int) -> None:
    """ValueError for a beam search whose beams cannot all run at once (engine/beam_groups.py:
    a search steps when all its beams have); `need`: the blocks of one beam at its longest."""
    k, length = req.beam.beam_width, req.num_prompt_tokens + req.beam.max_tokens
    if k > max_num_seqs:
        raise ValueError(f"beam_width {k} is more than the engine's {max_num_seqs} sequences (max_num_seqs): "
                         "lower beam_width or raise max_num_seqs")
    if length > max_model_len:
        raise ValueError(f"the prompt's {req.num_prompt_tokens} tokens + max_tokens {req.beam.max_tokens} are more "
                         f"than max_model_len {max_model_len}: lower max_tokens")
    if k * need > num_blocks:
        raise ValueError(f"{k} beams of {length} tokens need {k * need} KV blocks; the engine has {num_blocks}: "
                         "lower beam_width or max_tokens, or give the KV cache more memory")


def check_prompt_length(num_prompt_tokens: int, max_model_len: int) -> None:
    if num_prompt_tokens >= max_model_len:
        raise ValueError(
            f"the prompt has {num_prompt_tokens} tokens but max_model_len is {max_model_len}, "
            "which leaves no room for output: shorten the prompt or raise max_model_len"
        )
