"""The eagle3 method of speculative decoding: an EAGLE-3 head (models/eagle3.py) drafting from
the target's own hidden states, with a one-layer KV cache of its own over the target's block ids.

The head's row at position p reads token p + 1, so a row goes through the head once that token
is known. Each step (`follow`, after the target's forward) the head takes the rows whose next
token is a prompt or known token; a sampling chunk's last row and its drafted rows wait in
`pending` (their features, fc of the target's hidden states) until the step's tokens are in.
Drafting (`propose`, after the update) first runs a request's kept pending rows, the last of
which guesses the first draft, then one row a draft on the head's own features. Rows a request
never drafts from (drafting off this step) run at its next step's `follow`; with async
scheduling that step's input may be the token still pending, which the head then reads on the
device."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from ember.config import EngineConfig
from ember.layers.attention import AttentionMetadata, get_attention_backend
from ember.layers.quant import model_weight_bytes
from ember.layers.transfer import to_device
from ember.loader.model_files import locate_model
from ember.loader.safetensors import iter_pt, iter_safetensors
from ember.loader.weights import load_weights
from ember.models.eagle3 import Eagle3Head, default_aux_layers, head_tensor_name
from ember.request import Request
from ember.runner.cuda_graph import DecodeGraphs
from ember.runner.draft_model import DraftCache, Drafted, DraftIds, DrawDrafts, kept_rows
from ember.scheduler.scheduler import SchedulerOutput


def _rows_before(entry: tuple[int, torch.Tensor] | None, end: int) -> tuple[int, torch.Tensor] | None:
    """Of pending rows (first position, features), those before position `end`; None if none."""
    if entry is None:
        return None
    first, features = entry
    return (first, features[:end - first]) if 0 < end - first <= len(features) else None


def _table_slots(table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """The cache slots of positions [n, m] of the requests whose block-table rows are table [n, W]
    (a position past the table reads its last column: the caller masks or never uses it)."""
    blocks = table.gather(1, (positions // block_size).clamp(max=table.shape[1] - 1))
    return blocks.to(torch.int64) * block_size + positions % block_size


class _DraftStep(nn.Module):
    """A draft step as DecodeGraphs captures a model: the features come from a static buffer;
    out: normed | prenorm."""

    def __init__(self, head: Eagle3Head, embed: nn.Module, max_rows: int) -> None:
        super().__init__()
        self.head, self.embed = head, embed
        size = head.config.hidden_size
        self.feature = torch.zeros(max_rows, size, dtype=head.model.norm.weight.dtype,
                                   device=head.model.norm.weight.device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        normed, prenorm = self.head(self.embed(input_ids), self.feature[:input_ids.shape[0]], positions, meta)
        return torch.cat([normed, prenorm], dim=-1)


class _DraftLoop(nn.Module):
    """A greedy propose's draft steps after its first, all in one module, so that one CUDA graph a
    batch size replays them (as DecodeGraphs captures a model): step s of row j runs the head at
    position positions[j] + s on the token step s - 1 picked (the first: input_ids) after the
    stream it left (the first: `feature`); out: [rows, steps] drafts. Row j writes its KV in its
    first limit[j] steps only (a slot of -1 after, as a graph's padding rows: positions its blocks
    may not hold; its later drafts are dropped); rows of seq_len 0 are the graph's padding."""

    def __init__(self, head: Eagle3Head, embed: nn.Module, steps: int, block_size: int, vocab_size: int,
                 ascending_d2t: bool, max_rows: int) -> None:
        super().__init__()
        self.head, self.embed, self.steps, self.block_size = head, embed, steps, block_size
        self.vocab_size, self.ascending_d2t = vocab_size, ascending_d2t
        self.max_position = head.model.rotary.cos_sin.shape[0] - 1  # a row past its limit may pass the table
        weight = head.model.norm.weight
        self.feature = torch.zeros(max_rows, head.config.hidden_size, dtype=weight.dtype, device=weight.device)
        self.limit = torch.zeros(max_rows, dtype=torch.int64, device=weight.device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        n, bs = input_ids.shape[0], self.block_size
        live = meta.seq_lens > 0
        limit, table = self.limit[:n], meta.block_tables
        ids, feature, drafts = input_ids, self.feature[:n], []
        for s in range(self.steps):
            pos = (positions + s).clamp(max=self.max_position)
            slots = torch.where(live & (limit > s), _table_slots(table, pos[:, None], bs)[:, 0], -1)
            step = AttentionMetadata(slot_mapping=slots, query_start_loc=meta.query_start_loc,
                                     seq_lens=torch.where(live, pos + 1, 0).to(torch.int32), block_tables=table,
                                     query_lens_cpu=meta.query_lens_cpu,
                                     seq_lens_cpu=[length + s for length in meta.seq_lens_cpu])
            normed, feature = self.head(self.embed(ids), feature, pos, step)
            ids = self.head.target_argmax(normed, self.vocab_size, self.ascending_d2t)
            drafts.append(ids)
        return torch.stack(drafts, dim=1)


class Eagle3Drafter(DraftCache):
    drafts_without_kv = 1  # the first draft comes from the last kept row, which the request's blocks hold

    def __init__(self, config: EngineConfig, target: nn.Module) -> None:
        spec = config.speculative_config
        head = spec.eagle3_config
        self.config = head.layer
        self.device = torch.device(config.device)
        self.block_size = config.block_size
        self.cache_dtype = config.kv_cache_torch_dtype
        files = locate_model(spec.model, "auto")
        previous = torch.get_default_dtype()
        torch.set_default_dtype(config.torch_dtype)
        try:
            with torch.device(self.device):
                self.model = Eagle3Head(head, config.max_model_len, get_attention_backend(config.attention_backend))
        finally:
            torch.set_default_dtype(previous)
        read = iter_pt if files.load_format == "pt" else iter_safetensors
        load_weights(self.model, self._weights(read(files.path, head_tensor_name)), source=str(files.path))
        self.model.eval()
        self.embed = self.model.model.embed_tokens if head.has_embedding else target.model.embed_tokens
        self.aux_layers = tuple(sorted(head.aux_layer_ids or default_aux_layers(config.model_config.num_layers)))
        self.vocab_size = config.model_config.vocab_size  # the target's: drafts and q are over its ids
        self.ascending_d2t = self.model.ascending_d2t(self.vocab_size)
        self.attach(target)
        self.weight_bytes = model_weight_bytes(self.model)
        # request id -> (the position of its first row not through the head, those rows' features)
        self.pending: dict[str, tuple[int, torch.Tensor]] = {}
        self.graphs: DecodeGraphs | None = None  # the draft steps (one row a request), on CUDA
        self.step: _DraftStep | None = None
        # a greedy propose's steps after its first, in one module (one graph a batch size on CUDA)
        steps = spec.num_speculative_tokens - 1
        self.loop = _DraftLoop(self.model, self.embed, steps, self.block_size, self.vocab_size, self.ascending_d2t,
                               config.max_num_seqs) if steps else None
        self.loop_graphs: DecodeGraphs | None = None

    def capture_graphs(self, max_num_seqs: int, max_blocks_per_seq: int) -> None:
        """CUDA graphs of a draft step at the decode batch sizes (after the cache exists)."""
        self.step = _DraftStep(self.model, self.embed, max_num_seqs)
        self.graphs = DecodeGraphs(self.step, max_num_seqs, max_blocks_per_seq, self.device)
        self.graphs.capture()
        if self.loop is not None:
            self.loop_graphs = DecodeGraphs(self.loop, max_num_seqs, max_blocks_per_seq, self.device)
            self.loop_graphs.capture()

    def _weights(self, tensors):
        for name, tensor in tensors:
            if name == "d2t":
                self.model.d2t.copy_(tensor.to(torch.int64))
            else:
                yield name, tensor

    def attach(self, target: nn.Module) -> None:
        """Have the target return the hidden states the head reads (a reloaded target again)."""
        target.model.aux_layers = self.aux_layers

    def release(self, request_id: str) -> None:
        self.pending.pop(request_id, None)

    @torch.inference_mode()
    def follow(self, plan: SchedulerOutput, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
               aux: torch.Tensor | None) -> None:
        """The step's rows (and earlier pending ones) whose next token is known through the head;
        the sampling chunks' last rows wait for the step's tokens. `aux`: the target's hidden
        states of the head's layers for every row of the step."""
        for req in plan.preempted:  # recomputed from the start: its rows come again
            self.pending.pop(req.request_id, None)
        features = self.model.combine(aux)
        # a copy: on CUDA the step's output buffer is the next graph replay's; where every row
        # waits (decode and verifying chunks only), one copy of them all, else each chunk's own
        # (a view would keep a prefill's rows alive)
        waiting = features.clone() if all(c.samples and c.num_new_tokens == len(c.draft_token_ids) + 1
                                           for c in plan.chunks) else None
        runs: list[tuple[Request, int, torch.Tensor]] = []
        table_rows: list[int] = []
        on_device: dict[int, int] = {}  # run -> the step's row whose input id is its last token (pending)
        row = 0
        for i, chunk in enumerate(plan.chunks):
            req, n, start = chunk.request, chunk.num_new_tokens, chunk.start
            known = n - (len(chunk.draft_token_ids) + 1 if chunk.samples else 0)
            first, parts = start, []
            kept = self._kept(req, start)
            if kept is not None:
                first, parts = kept[0], [kept[1]]
                if req.num_pending_tokens:  # async scheduling: token `start` is sampled by the step in flight
                    on_device[len(runs)] = row
            if known:
                parts.append(features[row:row + known])
            if chunk.samples:
                rows = waiting[row:row + n] if waiting is not None else features[row + known:row + n].clone()
                self.pending[req.request_id] = (start + known, rows)
            if parts:
                runs.append((req, first, torch.cat(parts) if len(parts) > 1 else parts[0]))
                table_rows.append(i)
            row += n
        if runs:
            self._run(runs, meta.block_tables[to_device(table_rows, self.device, torch.int64)],
                      on_device=(on_device, input_ids) if on_device else None)

    def _kept(self, req: Request, end: int) -> tuple[int, torch.Tensor] | None:
        """A request's pending rows before position `end` (the rest were rejected drafts), taken out."""
        return _rows_before(self.pending.pop(req.request_id, None), end)

    def _run(self, runs: list[tuple[Request, int, torch.Tensor]], tables: torch.Tensor,
             on_device: tuple[dict[int, int], torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows through the head, each run a request's rows from its position `first` on (token
        p + 1 at position p); (normed, prenorm) at each run's last row.
        `on_device`: (run -> row, the step's input ids): a run whose last token is not known on
        the CPU yet takes it from that row of the step's input, gathered on the device."""
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        ends: list[int] = []
        lengths: list[int] = []
        starts = [0]
        dst: list[int] = []
        src: list[int] = []
        for j, (req, first, features) in enumerate(runs):
            rows = features.shape[0]
            end = first + rows
            if on_device is not None and j in on_device[0]:
                ids += req.token_slice(first + 1, end) + [0]
                dst.append(len(ids) - 1)
                src.append(on_device[0][j])
            else:
                ids += req.token_slice(first + 1, end + 1)
            positions += range(first, end)
            slots += [req.block_ids[p // bs] * bs + p % bs for p in range(first, end)]
            ends.append(end)
            lengths.append(rows)
            starts.append(starts[-1] + rows)
        t, n = len(positions), len(runs)
        flat = to_device(ids + positions + slots + ends + starts, self.device, torch.int64)
        ids_t, pos_t, slot_t, lens, starts_t = flat.split([len(ids), t, t, n, n + 1])
        if dst:
            ids_t[to_device(dst, self.device, torch.int64)] = on_device[1][to_device(src, self.device, torch.int64)]
        meta = AttentionMetadata(slot_mapping=slot_t, query_start_loc=starts_t.to(torch.int32),
                                 seq_lens=lens.to(torch.int32), block_tables=tables,
                                 query_lens_cpu=lengths, seq_lens_cpu=ends)
        features = torch.cat([f for _, _, f in runs]) if n > 1 else runs[0][2]
        if self.graphs is not None and t == n <= self.graphs.max_batch:  # a row a run (no draft was kept)
            return self._replay(ids_t, pos_t, slot_t, meta.seq_lens, tables, features)
        normed, prenorm = self.model(self.embed(ids_t), features, pos_t, meta)
        last = starts_t[1:] - 1
        return normed[last], prenorm[last]

    @torch.inference_mode()
    def propose(self, requests: list[Request], limits: list[int], tables: list[np.ndarray],
                draw: DrawDrafts | None) -> list[list[int]]:
        """Up to limits[i] drafts for requests[i], each picked by `draw` from the head's logits
        over the target's vocabulary (None: their argmax, fed to the next position on the
        device): its kept pending rows through the head give the first, then one row a draft;
        `tables`: each request's block-table row."""
        drafted = Drafted(len(requests))
        runs, active = [], []
        parents = {r.parent.request_id: self.pending.get(r.parent.request_id) for r in requests if r.parent is not None}
        for i, (req, limit) in enumerate(zip(requests, limits)):
            if limit < 1:
                continue  # its rows wait for its next step's follow
            kept = self._kept(req, req.num_computed_tokens)
            if kept is None and req.parent is not None:  # a fork's first step: its parent's prompt rows
                kept = _rows_before(parents[req.parent.request_id], req.num_computed_tokens)
            if kept is None:
                continue
            runs.append((req, *kept))
            active.append(i)
        if not runs:
            return drafted.result()
        width = max(len(requests[i].block_ids) for i in active)
        table = to_device(np.stack([tables[i][:width] for i in active]), self.device)
        normed, feature = self._run(runs, table)
        token = self._pick(normed, active, draw)
        steps = max(limits[i] for i in active)
        computed = [requests[i].num_computed_tokens for i in active]
        writes = [limits[i] - 1 for i in active]  # each request's draft steps after the first
        if draw is None and steps > 1 and self._loops(writes):
            drafted.add(active, token)
            drafted.add(active, self._draft_loop(token, feature, computed, writes, table), writes)
            return drafted.result()
        if steps > 1:
            rows = self._draft_rows(computed, steps - 1, table)
            starts = torch.arange(len(active) + 1, dtype=torch.int32, device=self.device)
        for step in range(1, steps):
            drafted.add(active, token)
            keep = [j for j, i in enumerate(active) if limits[i] > step]
            if not keep:
                return drafted.result()
            if len(keep) < len(active):
                index = to_device(keep, self.device, torch.int64)
                active, table, feature = [active[j] for j in keep], table[index], feature[index]
                rows = tuple(r[:, index] for r in rows)
                computed = [computed[j] for j in keep]
                token = kept_rows(token, keep, index)
            normed, feature = self._draft_step(token, *(r[step - 1] for r in rows), [c + step for c in computed],
                                               table, feature, starts[:len(active) + 1])
            token = self._pick(normed, active, draw)
        drafted.add(active, token)
        return drafted.result()

    def _loops(self, writes: list[int]) -> bool:
        """Whether `_DraftLoop` takes these requests' draft steps: on CUDA any (a step past a request's
        own steps writes no KV), elsewhere where each takes them all (the CPU's KV write has no slot -1)."""
        if self.loop is None or len(writes) > self.loop.limit.shape[0]:
            return False
        return self.device.type == "cuda" or all(w == self.loop.steps for w in writes)

    def _draft_loop(self, token: torch.Tensor, feature: torch.Tensor, computed: list[int], writes: list[int],
                    table: torch.Tensor) -> torch.Tensor:
        """The draft steps after the first through `_DraftLoop`, from its CUDA graph where one is
        captured: [n, K - 1] drafts; request j's first step at position computed[j], its KV written
        in its first writes[j] steps."""
        n = len(computed)
        positions, limit = to_device(computed + writes, self.device, torch.int64).split([n, n])
        self.loop.feature[:n].copy_(feature)
        self.loop.limit[:n].copy_(limit)
        lens = (positions + 1).to(torch.int32)
        if self.loop_graphs is not None and n <= self.loop_graphs.max_batch:
            return self.loop_graphs.run(token, positions, positions, lens, table)  # slots: the loop's own
        meta = AttentionMetadata(slot_mapping=positions, query_start_loc=torch.arange(
            n + 1, dtype=torch.int32, device=self.device), seq_lens=lens, block_tables=table,
            query_lens_cpu=[1] * n, seq_lens_cpu=[c + 1 for c in computed])
        return self.loop(token, positions, meta)

    def _draft_rows(self, computed: list[int], steps: int,
                    table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The draft steps' rows, built once a propose on the device: (positions, slots, seq_lens),
        each [steps, requests], step s of request j at position computed[j] + s, its slot read from
        the block table (a position past a request's blocks, of a step it does not draft in, reads
        the table's last column: never used)."""
        bs = self.block_size
        positions = to_device(computed, self.device, torch.int64)[None, :] \
            + torch.arange(steps, device=self.device, dtype=torch.int64)[:, None]
        slots = _table_slots(table, positions.T, bs).T.contiguous()
        return positions, slots, (positions + 1).to(torch.int32)

    def _draft_step(self, tokens: DraftIds, positions: torch.Tensor, slot_t: torch.Tensor, lens: torch.Tensor,
                    seq_lens: list[int], table: torch.Tensor, feature: torch.Tensor,
                    starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft row a request: token `tokens[j]` at `positions[j]` (slot `slot_t[j]`, seq_len
        `lens[j]`, on the device; `seq_lens` on the host) over the request's blocks (`table[j]`)
        after the head's own `feature[j]`; (normed, prenorm) a row, from a CUDA graph where one is
        captured."""
        ids_t = tokens if isinstance(tokens, torch.Tensor) else to_device(tokens, self.device, torch.int64)
        n = len(seq_lens)
        if self.graphs is not None and n <= self.graphs.max_batch:
            return self._replay(ids_t, positions, slot_t, lens, table, feature)
        meta = AttentionMetadata(slot_mapping=slot_t, query_start_loc=starts, seq_lens=lens, block_tables=table,
                                 query_lens_cpu=[1] * n, seq_lens_cpu=seq_lens)
        return self.model(self.embed(ids_t), feature, positions, meta)

    def _replay(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, seq_lens: torch.Tensor,
                tables: torch.Tensor, feature: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A row a request through the head's CUDA graph (the draft step's); (normed, prenorm)."""
        n = ids.shape[0]
        self.step.feature[:n].copy_(feature)
        out = self.graphs.run(ids, positions, slots, seq_lens, tables)
        return out[:, :feature.shape[1]].contiguous(), out[:, feature.shape[1]:]

    def _pick(self, normed: torch.Tensor, active: list[int], draw: DrawDrafts | None) -> DraftIds:
        """A draft position's drafts: drawn by `draw` from the target vocabulary's logits, or their
        argmax on the device."""
        if draw is not None:
            return draw(self.model.target_logits(normed, self.vocab_size), active)
        return self.model.target_argmax(normed, self.vocab_size, self.ascending_d2t)
