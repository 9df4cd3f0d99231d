"""The Triton attention kernels against the plain-torch reference backend, at random
shapes and shuffled block tables, with caches in the compute dtype and in fp8 (with unit
and non-unit scales), and with the layer options (sliding window, logit soft cap); the
multi-head latent attention decode kernel against MLA decode written out in torch. Each case
runs twice: on the CPU through Triton's interpreter (small shapes, every run) and on CUDA
(`-m gpu`, larger shapes)."""

from __future__ import annotations

import os
import random

import pytest
import torch

triton = pytest.importorskip("triton")

from float_order import same_bits  # noqa: E402
from hopper_compile import run_compile_script  # noqa: E402

from ember.kernels import cpu as cpu_kernels  # noqa: E402
from ember.kernels.decode_attention import _decode_split_kernel, decode_attention, decode_config, num_decode_splits  # noqa: E402
from ember.kernels.kv_write import kv_write  # noqa: E402
from ember.kernels.mla_decode import mla_decode, mla_head_blocks  # noqa: E402
from ember.kernels.prefill_attention import prefill_attention  # noqa: E402
from ember.layers.attention import AttentionMetadata, get_attention_backend  # noqa: E402
from ember.layers.attention.torch_ref import FP8, FP8_MAX, quantize_kv, write_kv  # noqa: E402


@pytest.fixture(autouse=True)
def plain_torch_reference():
    """The reference is the plain-torch layer code, not the C++ CPU kernels."""
    with cpu_kernels.disabled():
        yield


DEVICES = [pytest.param("cpu", id="interpreter"), pytest.param("cuda", marks=pytest.mark.gpu, id="cuda")]


def _dtype(device: str) -> torch.dtype:
    return torch.bfloat16 if device == "cuda" else torch.float32


def _tol(device: str) -> dict:
    return dict(atol=2e-2, rtol=2e-2) if device == "cuda" else dict(atol=1e-4, rtol=1e-4)


def test_interpreter_is_what_runs_on_the_cpu():
    """Without CUDA the kernels are the interpreter's (so the CPU tests execute them)."""
    if torch.cuda.is_available():
        pytest.skip("CUDA present: kernels are compiled")
    assert os.environ.get("TRITON_INTERPRET") == "1"
    assert type(_decode_split_kernel).__name__ == "InterpretedFunction"


# an fp8 cache's (k_scale, v_scale): vLLM's default 1.0, and calibrated-looking others
FP8_SCALES = [pytest.param((1.0, 1.0), id="scale1"), pytest.param((0.5, 3.0), id="scaled")]


class Case:
    """Sequences with cached[i] tokens already in a shuffled paged cache and new[i] new ones.
    With fp8_scales the cache is float8_e4m3fn holding K / k_scale, V / v_scale. With
    shared_kv, as multi-head latent attention runs: v is k and v_cache IS k_cache (one plane)."""

    def __init__(self, cached, new, heads, kv_heads, head_dim, block_size, device, seed, fp8_scales=None,
                 dtype=None, shared_kv=False):
        g = torch.Generator().manual_seed(seed)
        dtype = dtype or _dtype(device)
        cache_dtype = dtype if fp8_scales is None else FP8
        self.k_scale = self.v_scale = None
        if fp8_scales is not None:
            self.k_scale, self.v_scale = (torch.tensor([x], dtype=torch.float32, device=device) for x in fp8_scales)
        self.cached, self.new = cached, new
        lens = [c + n for c, n in zip(cached, new)]
        num_blocks = sum(-(-n // block_size) for n in lens) + 3
        order = torch.randperm(num_blocks, generator=g).tolist()  # non-contiguous, shuffled blocks
        tables = []
        for n in lens:
            tables.append([order.pop() for _ in range(-(-n // block_size))])
        width = max(len(t) for t in tables) + 1  # a spare column: reads past a table's end are masked
        k_ctx = [torch.randn(n, kv_heads, head_dim, generator=g).to(dtype) for n in lens]
        v_ctx = k_ctx if shared_kv else [torch.randn(n, kv_heads, head_dim, generator=g).to(dtype) for n in lens]
        self.k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(cache_dtype)  # junk
        self.v_cache = self.k_cache if shared_kv else \
            torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(cache_dtype)
        slots = []
        scales = [None if s is None else s.cpu() for s in (self.k_scale, self.v_scale)]
        for i, (c, n) in enumerate(zip(cached, new)):
            for p in range(c + n):
                slot = tables[i][p // block_size] * block_size + p % block_size
                if p < c:  # the cached prefix is in place already
                    self.k_cache.view(-1, kv_heads, head_dim)[slot] = quantize_kv(k_ctx[i][p], cache_dtype, scales[0])
                    self.v_cache.view(-1, kv_heads, head_dim)[slot] = quantize_kv(v_ctx[i][p], cache_dtype, scales[1])
                else:
                    slots.append(slot)
        self.q = torch.randn(sum(new), heads, head_dim, generator=g).to(dtype)
        self.k = torch.cat([kk[c:] for kk, c in zip(k_ctx, cached)])
        self.v = torch.cat([vv[c:] for vv, c in zip(v_ctx, cached)])
        starts = [0]
        for n in new:
            starts.append(starts[-1] + n)
        self.meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            seq_lens=torch.tensor(lens, dtype=torch.int32),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
            query_lens_cpu=list(new), seq_lens_cpu=lens)
        for name in ("k_cache", "v_cache", "q", "k", "v"):
            setattr(self, name, getattr(self, name).to(device))
        if shared_kv:  # one tensor on the device too
            self.v_cache, self.v = self.k_cache, self.k
        for name in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables"):
            setattr(self.meta, name, getattr(self.meta, name).to(device))
        self.scale = head_dim ** -0.5

    @property
    def scales(self) -> dict:
        return dict(k_scale=self.k_scale, v_scale=self.v_scale)

    def reference(self, sliding_window: int | None = None, logit_softcap: float | None = None,
                  sinks: torch.Tensor | None = None, attention_chunk: int | None = None) -> torch.Tensor:
        """The torch backend in float32 on copies of the caches (it writes K/V into them);
        an fp8 cache stays fp8, quantized and read back by the reference's own rules."""
        kc, vc = ((c.clone() if c.dtype == FP8 else c.float().clone()) for c in (self.k_cache, self.v_cache))
        meta = AttentionMetadata(**{f: getattr(self.meta, f) for f in
                                    ("slot_mapping", "query_start_loc", "seq_lens", "block_tables",
                                     "query_lens_cpu", "seq_lens_cpu", "key_ends")})
        return get_attention_backend("torch").forward(self.q.float(), self.k.float(), self.v.float(), kc, vc,
                                                      meta, self.scale, **self.scales, sliding_window=sliding_window,
                                                      logit_softcap=logit_softcap, sinks=sinks,
                                                      attention_chunk=attention_chunk)

    def poison_unseen(self, window: int | None = None, chunk: int | None = None) -> int:
        """NaN into the cached K and V of every position that no new query of its sequence
        may see (before the first new token's window, or its chunk): a kernel that reads one
        gets NaN out (0 * NaN in P @ V), so this checks that the tiles before a window are
        skipped, not only masked. Returns how many positions it poisoned."""
        block_size, kv_heads, dim = self.k_cache.shape[1:]
        tables = self.meta.block_tables.tolist()
        slots = [tables[i][p // block_size] * block_size + p % block_size
                 for i, c in enumerate(self.cached)
                 # the first new query (position c) sees keys > c - W, or from c // C * C
                 for p in range(max(0, c - window + 1) if window is not None else c // chunk * chunk)]
        if slots:
            index = torch.tensor(slots, device=self.k_cache.device)
            for cache in (self.k_cache, self.v_cache):
                if cache.dtype == FP8:
                    cache.view(torch.uint8).view(-1, kv_heads, dim)[index] = 0x7F  # e4m3fn's NaN
                else:
                    cache.view(-1, kv_heads, dim)[index] = float("nan")
        return len(slots)


def _random_case(device: str, seed: int, decode: bool, fp8_scales=None, dtype=None) -> Case:
    rng = random.Random(seed)
    if device == "cuda":
        batch, most, heads, kv_heads, head_dim, block_size = rng.randint(1, 40), 3000, *rng.choice(
            [(16, 8, 128, 16), (32, 8, 128, 16), (8, 8, 64, 32), (12, 4, 128, 16)])
    else:
        batch, most, heads, kv_heads, head_dim, block_size = rng.randint(1, 4), 90, *rng.choice(
            [(4, 2, 16, 4), (4, 1, 32, 8), (2, 2, 16, 16)])
    new = [1 if decode else rng.randint(1, most // 3) for _ in range(batch)]
    cached = [rng.randint(0, most) for _ in range(batch)]
    if not decode:
        cached[0] = 0  # a plain prefill in every mix
    return Case(cached, new, heads, kv_heads, head_dim, block_size, device, seed, fp8_scales, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", [0, 1])
def test_kv_write_matches_index_copy(device, seed):
    case = _random_case(device, seed, decode=False)
    want_k, want_v = case.k_cache.clone(), case.v_cache.clone()
    write_kv(case.k, case.v, want_k, want_v, case.meta.slot_mapping)
    # a padded row (slot -1, as in a CUDA graph) writes nothing
    k = torch.cat([case.k, torch.ones_like(case.k[:1])])
    v = torch.cat([case.v, torch.ones_like(case.v[:1])])
    slots = torch.cat([case.meta.slot_mapping, torch.full((1,), -1, device=device)])
    kv_write(k, v, case.k_cache, case.v_cache, slots)
    assert torch.equal(case.k_cache, want_k) and torch.equal(case.v_cache, want_v)


def test_kv_write_checks_layouts():
    k = torch.zeros(3, 2, 16)
    cache = torch.zeros(4, 4, 2, 16)
    with pytest.raises(ValueError, match="heads contiguous"):
        kv_write(k.transpose(0, 1).contiguous().transpose(0, 1), k, cache, cache, torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="slot_mapping"):
        kv_write(k, k, cache, cache, torch.zeros(2, dtype=torch.int64))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("pack_gqa", [False, True], ids=["by-head", "gqa-packed"])
def test_prefill_matches_reference(device, seed, pack_gqa):
    """Both layouts (pack_gqa: a program takes a KV head's query heads, as deterministic mode
    runs every row); the packed one must also give the same bits to a row as a decode row,
    alone, as in its prefill (batch invariance: the mode's reason)."""
    case = _random_case(device, seed, decode=False)
    want = case.reference()
    kv_write(case.k, case.v, case.k_cache, case.v_cache, case.meta.slot_mapping)
    block = 64 if device == "cuda" else 16
    run = lambda q, starts, lens, tables, longest: prefill_attention(  # noqa: E731
        q, case.k_cache, case.v_cache, tables, starts, lens, longest, case.scale, block_m=block, block_n=block,
        pack_gqa=pack_gqa)
    got = run(case.q, case.meta.query_start_loc, case.meta.seq_lens, case.meta.block_tables, max(case.new))
    torch.testing.assert_close(got.float(), want, **_tol(device))
    if pack_gqa:  # the last new token of each sequence as a lone decode row
        ends = case.meta.query_start_loc[1:].long() - 1
        one = torch.arange(len(case.new) + 1, dtype=torch.int32, device=case.q.device)
        alone = run(case.q[ends].contiguous(), one, case.meta.seq_lens, case.meta.block_tables, 1)
        same_bits(alone, got[ends])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_decode_matches_reference(device, seed):
    case = _random_case(device, seed, decode=True)
    want = case.reference()
    kv_write(case.k, case.v, case.k_cache, case.v_cache, case.meta.slot_mapping)
    block = 64 if device == "cuda" else 16
    splits = [1, 3, num_decode_splits(len(case.new), case.k_cache.shape[2])]
    for s in splits:  # one split writes the output directly; several merge their partials
        got = decode_attention(case.q, case.k_cache, case.v_cache, case.meta.block_tables, case.meta.seq_lens,
                               case.scale, num_splits=s, block_n=block)
        torch.testing.assert_close(got.float(), want, **_tol(device), msg=lambda m: f"{s} splits: {m}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window", [None, 9])
def test_attention_sinks_match_reference(device, window):
    """gpt-oss's sinks (a logit a query head in the softmax's denominator): prefill, decode
    in one split and merged from several, and the backend's mixed step, against the torch
    backend's sink column; with a window too, as gpt-oss's sliding layers have."""
    heads = 4 if device == "cpu" else 16
    sinks = torch.linspace(-1.5, 2.5, heads, device=device)
    pre = Case([0, 40, 17], [23, 9, 30], heads, 2, 16 if device == "cpu" else 64, 8, device, seed=5)
    want = pre.reference(sliding_window=window, sinks=sinks)
    kv_write(pre.k, pre.v, pre.k_cache, pre.v_cache, pre.meta.slot_mapping)
    got = prefill_attention(pre.q, pre.k_cache, pre.v_cache, pre.meta.block_tables, pre.meta.query_start_loc,
                            pre.meta.seq_lens, 30, pre.scale, block_m=16, block_n=16, sliding_window=window,
                            sinks=sinks)
    torch.testing.assert_close(got.float(), want, **_tol(device))
    dec = Case([1, 60, 33], [1, 1, 1], heads, 2, 16 if device == "cpu" else 64, 8, device, seed=6)
    want = dec.reference(sliding_window=window, sinks=sinks)
    kv_write(dec.k, dec.v, dec.k_cache, dec.v_cache, dec.meta.slot_mapping)
    for splits in (1, 3):
        got = decode_attention(dec.q, dec.k_cache, dec.v_cache, dec.meta.block_tables, dec.meta.seq_lens, dec.scale,
                               num_splits=splits, block_n=16, sliding_window=window, sinks=sinks)
        torch.testing.assert_close(got.float(), want, **_tol(device), msg=lambda m: f"{splits} splits: {m}")
    mixed = Case([12, 0, 30], [1, 20, 5], heads, 2, 16 if device == "cpu" else 64, 8, device, seed=7)
    want = mixed.reference(sliding_window=window, sinks=sinks)
    got = get_attention_backend("triton").forward(mixed.q, mixed.k, mixed.v, mixed.k_cache, mixed.v_cache, mixed.meta, mixed.scale,
                                                 sliding_window=window, sinks=sinks)
    torch.testing.assert_close(got.float(), want, **_tol(device))


@pytest.mark.parametrize("device", DEVICES)
def test_pages_holding_whole_tiles_match_reference(device):
    """A page that holds whole tiles (CUDA's 128-token blocks) is read with one block-table
    read a tile: prefill and decode, one and two tiles a page, shuffled blocks."""
    page, tiles = (128, [128, 64]) if device == "cuda" else (32, [32, 16])
    for block_n in tiles:
        case = Case([0, 45, 70], [33, 20, 3], 4, 2, 16, page, device, seed=block_n)
        want = case.reference()
        kv_write(case.k, case.v, case.k_cache, case.v_cache, case.meta.slot_mapping)
        got = prefill_attention(case.q, case.k_cache, case.v_cache, case.meta.block_tables,
                                case.meta.query_start_loc, case.meta.seq_lens, 33, case.scale, block_m=16,
                                block_n=block_n)
        torch.testing.assert_close(got.float(), want, **_tol(device))
        dec = Case([1, 80, 100], [1, 1, 1], 4, 2, 16, page, device, seed=block_n + 1)
        want = dec.reference()
        kv_write(dec.k, dec.v, dec.k_cache, dec.v_cache, dec.meta.slot_mapping)
        for splits in (1, 3):
            got = decode_attention(dec.q, dec.k_cache, dec.v_cache, dec.meta.block_tables, dec.meta.seq_lens,
                                   dec.scale, num_splits=splits, block_n=block_n)
            torch.testing.assert_close(got.float(), want, **_tol(device))


@pytest.mark.parametrize("device", DEVICES)
def test_decode_padding_rows_give_zeros(device):
    """A CUDA graph's padded rows (seq_len 0) must not produce NaN."""
    case = _random_case(device, 0, decode=True)
    kv_write(case.k, case.v, case.k_cache, case.v_cache, case.meta.slot_mapping)
    lens = case.meta.seq_lens.clone()
    lens[0] = 0
    got = decode_attention(case.q, case.k_cache, case.v_cache, case.meta.block_tables, lens, case.scale,
                           num_splits=2, block_n=64 if device == "cuda" else 16)
    assert torch.all(got[0] == 0) and not got.isnan().any()


# a mixed step's sequences (cached, new tokens) and how many leading decode rows go to
# flash-decoding: none when the decodes come last (the prefill kernel takes them all)
MIXED_STEPS = [pytest.param(([0, 37, 5, 60], [20, 9, 1, 1]), 0, id="decodes-last"),
               pytest.param(([5, 60, 0, 37, 44], [1, 1, 20, 9, 1]), 2, id="decodes-first")]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("lens, decode_rows", MIXED_STEPS)
def test_triton_backend_matches_reference_on_a_mixed_step(device, lens, decode_rows):
    """The backend itself: a step mixing prefills, a prefix-cached extend and decodes."""
    case = Case(*lens, 4, 2, 32, 8, device, seed=3)
    want = case.reference()
    backend = get_attention_backend("triton")
    got = backend.forward(case.q, case.k, case.v, case.k_cache, case.v_cache, case.meta, case.scale)
    assert backend.plan(case.meta, 2).decode_rows == decode_rows
    torch.testing.assert_close(got.float(), want, **_tol(device))


@pytest.mark.parametrize("device", DEVICES)
def test_a_verifying_step_as_decode_rows_matches_reference(device):
    """Speculative decoding's verifying step in the decode graphs' form: decodes with 3 and 4
    drafts and a plain decode, each token a decode row over its sequence's blocks
    (AttentionMetadata.as_decode_rows): flash-decoding takes them all."""
    case = Case([30, 5, 61], [4, 1, 5], 4, 2, 32, 8, device, seed=5)
    want = case.reference()
    backend = get_attention_backend("triton")
    rows = case.meta.as_decode_rows()
    got = backend.forward(case.q, case.k, case.v, case.k_cache, case.v_cache, rows, case.scale)
    assert backend.plan(rows, 2).decode  # every row a decode: the decode kernel alone
    torch.testing.assert_close(got.float(), want, **_tol(device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window", [None, 6], ids=["causal", "window"])
def test_key_ends_let_image_tokens_see_their_whole_image(device, window):
    """Gemma 3's images (key_ends, layers/attention/base.py) in a step of a decode row (first: to
    flash-decoding), a prefill with images at 10..25 (past its first 16-row tile) and 30..34, and
    an extend of 20..31 over a cached prefix with an image at 22..29: the backend, and the prefill
    kernel alone in 16 x 16 tiles, both layouts, against the torch reference; its image rows are
    not the causal ones."""
    case = Case([5, 0, 20], [1, 40, 12], 4, 2, 16, 4, device, seed=5)
    ends = [6] + list(range(1, 41)) + list(range(21, 33))  # each row's position + 1
    for first, start, end in ((1, 10, 26), (1, 30, 35), (41 - 20, 22, 30)):  # rows: first + position
        ends[first + start:first + end] = [end] * (end - start)
    want_causal = case.reference(sliding_window=window)
    case.meta.key_ends = torch.tensor(ends, dtype=torch.int32, device=device)
    want = case.reference(sliding_window=window)
    assert (want - want_causal).abs().amax(dim=(1, 2)).gt(1e-3).sum() >= 20
    got = get_attention_backend("triton").forward(case.q, case.k, case.v, case.k_cache, case.v_cache, case.meta,
                                                  case.scale, sliding_window=window)
    torch.testing.assert_close(got.float(), want, **_tol(device))
    for pack_gqa in (False, True):
        tiled = prefill_attention(case.q, case.k_cache, case.v_cache, case.meta.block_tables,
                                  case.meta.query_start_loc, case.meta.seq_lens, 40, case.scale, block_m=16,
                                  block_n=16, sliding_window=window, pack_gqa=pack_gqa, key_ends=case.meta.key_ends)
        torch.testing.assert_close(tiled.float(), want, **_tol(device))


_COMPILE_KEY_ENDS = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from ember.kernels.prefill_attention import _prefill_kernel

names = list(_prefill_kernel.arg_names)
types = {"q_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16", "o_ptr": "*bf16", "tables_ptr": "*i32",
         "query_start_ptr": "*i32", "seq_lens_ptr": "*i32", "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32",
         "sinks_ptr": "*bf16", "key_ends_ptr": "*i32", "scale_log2": "fp32", "softcap": "fp32"}
for pack_gqa in (False, True):
    constants = dict(GROUP=2, D=256, BLOCK_D=256, BLOCK_M=64, BLOCK_N=64, PAGE=16, FP8=False, DOT_FP16=False,
                     SLIDING=True, CHUNKED=False, SOFTCAP=False, PACK_GQA=pack_gqa, SHARED_KV=False, SINKS=False,
                     KEY_ENDS=True)
    signature = {n: types.get(n, "constexpr" if n in constants else "i32") for n in names}
    source = ASTSource(_prefill_kernel, signature, {(names.index(k),): v for k, v in constants.items()})
    triton.compile(source, target=GPUTarget("cuda", 90, 32))
print("compiled")
"""


@pytest.mark.slow
def test_the_prefill_kernel_with_key_ends_compiles_for_hopper():
    """Gemma 3's image rows (KEY_ENDS) with a window, at its 256-dim heads, both layouts: Triton
    compiles the prefill kernel to sm_90 here, without a GPU."""
    assert "compiled" in run_compile_script(_COMPILE_KEY_ENDS)


_COMPILE_TILES = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from ember.kernels.prefill_attention import _prefill_kernel, prefill_tiles

names = list(_prefill_kernel.arg_names)
for dtype, size, dim, shared_kv in (("fp32", 4, 256, False), ("fp32", 4, 1024, True), ("bf16", 2, 256, False)):
    types = {"q_ptr": "*" + dtype, "k_cache_ptr": "*" + dtype, "v_cache_ptr": "*" + dtype, "o_ptr": "*" + dtype,
             "tables_ptr": "*i32", "query_start_ptr": "*i32", "seq_lens_ptr": "*i32", "k_scale_ptr": "*fp32",
             "v_scale_ptr": "*fp32", "sinks_ptr": "*" + dtype, "key_ends_ptr": "*i32", "scale_log2": "fp32",
             "softcap": "fp32"}
    block_m, block_n, warps, stages = prefill_tiles(dim, size)
    constants = dict(GROUP=2, D=dim, BLOCK_D=dim, BLOCK_M=block_m, BLOCK_N=block_n, PAGE=16, FP8=False,
                     DOT_FP16=False, SLIDING=True, CHUNKED=False, SOFTCAP=False, PACK_GQA=False, SHARED_KV=shared_kv,
                     SINKS=False, KEY_ENDS=True)
    signature = {n: types.get(n, "constexpr" if n in constants else "i32") for n in names}
    source = ASTSource(_prefill_kernel, signature, {(names.index(k),): v for k, v in constants.items()})
    options = {k: v for k, v in dict(num_warps=warps, num_stages=stages).items() if v}
    print(dtype, dim, triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).metadata.shared)
"""


@pytest.mark.slow
def test_the_prefill_tiles_fit_hoppers_shared_memory_in_float32_too():
    """float32 at Gemma's 256-dim heads (and MLA's 1024 with one shared K/V tile): the tiles
    prefill_tiles picks compile to sm_90 within its 227 KB of shared memory a block (64 x 64 in
    3 stages asked 328 KB: the CUDA Gemma 3 test's launch failed)."""
    shared = {tuple(line.split()[:2]): int(line.split()[2]) for line in run_compile_script(_COMPILE_TILES).splitlines()}
    assert set(shared) == {("fp32", "256"), ("fp32", "1024"), ("bf16", "256")}
    assert all(0 < used <= 232448 for used in shared.values()), shared


_COMPILE_DECODE_TILES = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from ember.kernels.decode_attention import _decode_split_kernel, decode_config

names = list(_decode_split_kernel.arg_names)
for dtype, size, dim, shared_kv in (("fp32", 4, 256, False), ("fp32", 4, 1024, True), ("bf16", 2, 256, False)):
    types = {"q_ptr": "*" + dtype, "k_cache_ptr": "*" + dtype, "v_cache_ptr": "*" + dtype, "o_ptr": "*" + dtype,
             "lse_ptr": "*fp32", "tables_ptr": "*i32", "seq_lens_ptr": "*i32", "k_scale_ptr": "*fp32",
             "v_scale_ptr": "*fp32", "sinks_ptr": "*" + dtype, "scale_log2": "fp32", "softcap": "fp32"}
    block_n, warps, stages = decode_config(False, dim, size)
    constants = dict(GROUP=2, BLOCK_H=16, HEAD_BLOCKS=1, D=dim, BLOCK_D=dim, BLOCK_N=block_n, PAGE=16, NUM_SPLITS=1,
                     FP8=False, DOT_FP16=False, SLIDING=True, CHUNKED=False, SOFTCAP=False, SHARED_KV=shared_kv,
                     SINKS=False)
    signature = {n: types.get(n, "constexpr" if n in constants else "i32") for n in names}
    source = ASTSource(_decode_split_kernel, signature, {(names.index(k),): v for k, v in constants.items()})
    options = dict(num_warps=warps, num_stages=stages)
    print(dtype, dim, triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).metadata.shared)
"""


@pytest.mark.slow
def test_the_decode_tiles_fit_hoppers_shared_memory_in_float32_too():
    """float32 at Gemma's 256-dim heads (and MLA's 1024 with one shared K/V tile): the tiles
    decode_config picks compile to sm_90 within its 227 KB of shared memory a block (128 rows of
    256 float32 dims asked 281 KB: the CUDA Gemma 3 vision test's decode graphs failed to launch)."""
    out = run_compile_script(_COMPILE_DECODE_TILES)
    shared = {tuple(line.split()[:2]): int(line.split()[2]) for line in out.splitlines()}
    assert set(shared) == {("fp32", "256"), ("fp32", "1024"), ("bf16", "256")}
    assert all(0 < used <= 232448 for used in shared.values()), shared
    assert decode_config(False, 256, 2) == (128, 4, 4) and decode_config(True, 256, 1) == (64, 2, 5)


def test_decode_checks_layouts():
    q = torch.zeros(2, 4, 16)
    cache = torch.zeros(4, 4, 3, 16)
    with pytest.raises(ValueError, match="does not fit"):
        decode_attention(q, cache, cache, torch.zeros(2, 1, dtype=torch.int32), torch.zeros(2, dtype=torch.int32),
                         1.0, 1)
    cache = torch.zeros(4, 4, 2, 16)
    with pytest.raises(ValueError, match="int32"):
        decode_attention(q, cache, cache, torch.zeros(2, 1, dtype=torch.int64), torch.zeros(2, dtype=torch.int32),
                         1.0, 1)


# ---- fp8 cache ----------------------------------------------------------------------------

def _bits(cache: torch.Tensor) -> torch.Tensor:
    return cache.view(torch.uint8)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp8_scales", FP8_SCALES)
@pytest.mark.parametrize("seed", [0, 1])
def test_kv_write_fp8_is_bit_exact(device, fp8_scales, seed):
    """The kernel stores the very bytes the reference does: x / scale, clamped to +-448, to
    nearest even; rows far past the range (here x 1000) saturate instead of becoming NaN."""
    case = _random_case(device, seed, decode=False, fp8_scales=fp8_scales)
    k, v = case.k.clone(), case.v.clone()
    k[::3] *= 1000
    v[1::4] *= -1000
    want_k, want_v = case.k_cache.clone(), case.v_cache.clone()
    write_kv(k, v, want_k, want_v, case.meta.slot_mapping, **case.scales)
    assert want_k.float().abs().max() == FP8_MAX and not want_k.float().isnan().any()
    k = torch.cat([k, torch.ones_like(k[:1])])  # a padded row (slot -1) writes nothing
    v = torch.cat([v, torch.ones_like(v[:1])])
    slots = torch.cat([case.meta.slot_mapping, torch.full((1,), -1, device=device)])
    kv_write(k, v, case.k_cache, case.v_cache, slots, **case.scales)
    assert torch.equal(_bits(case.k_cache), _bits(want_k)) and torch.equal(_bits(case.v_cache), _bits(want_v))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp8_scales", FP8_SCALES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_prefill_fp8_matches_reference(device, fp8_scales, seed):
    case = _random_case(device, seed, decode=False, fp8_scales=fp8_scales)
    want = case.reference()
    kv_write(case.k, case.v, case.k_cache, case.v_cache, case.meta.slot_mapping, **case.scales)
    block = 64 if device == "cuda" else 16
    got = prefill_attention(case.q, case.k_cache, case.v_cache, case.meta.block_tables, case.meta.query_start_loc,
                            case.meta.seq_lens, max(case.new), case.scale, block_m=block, block_n=block,
                            **case.scales)
    torch.testing.assert_close(got.float(), want, **_tol(device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp8_scales", FP8_SCALES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_decode_fp8_matches_reference(device, fp8_scales, seed):
    case = _random_case(device, seed, decode=True, fp8_scales=fp8_scales)
    want = case.reference()
    kv_write(case.k, case.v, case.k_cache, case.v_cache, case.meta.slot_mapping, **case.scales)
    block = 64 if device == "cuda" else 16
    for s in [1, 3, num_decode_splits(len(case.new), case.k_cache.shape[2])]:
        got = decode_attention(case.q, case.k_cache, case.v_cache, case.meta.block_tables, case.meta.seq_lens,
                               case.scale, num_splits=s, block_n=block, **case.scales)
        torch.testing.assert_close(got.float(), want, **_tol(device), msg=lambda m: f"{s} splits: {m}")


@pytest.mark.parametrize("device", DEVICES)
def test_decode_fp8_stays_near_the_unquantized_cache(device):
    """What fp8 costs: the same case with an fp8 cache (scale 1) and with the compute dtype's
    (float32 on the CPU); unit-variance K/V lose ~3% each to e4m3's 3 mantissa bits."""
    exact = _random_case(device, 5, decode=True).reference()
    quantized = _random_case(device, 5, decode=True, fp8_scales=(1.0, 1.0)).reference()
    err = (quantized - exact).abs()
    assert err.max() < 0.25 and err.mean() < 0.02, (err.max(), err.mean())  # CPU: 0.025, 0.004


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp8_scales", FP8_SCALES)
@pytest.mark.parametrize("lens, decode_rows", MIXED_STEPS)
def test_triton_backend_fp8_matches_reference_on_a_mixed_step(device, fp8_scales, lens, decode_rows):
    case = Case(*lens, 4, 2, 32, 8, device, seed=3, fp8_scales=fp8_scales)
    want = case.reference()
    backend = get_attention_backend("triton")
    got = backend.forward(case.q, case.k, case.v, case.k_cache, case.v_cache, case.meta, case.scale, case.k_scale,
                          case.v_scale)
    assert backend.plan(case.meta, 2).decode_rows == decode_rows
    torch.testing.assert_close(got.float(), want, **_tol(device))


@pytest.mark.parametrize("seed", [0, 1])
def test_fp8_with_bfloat16_queries_on_the_interpreter(seed):
    """bfloat16 queries over an fp8 cache take the float16 dots (DOT_FP16, as on the GPU);
    here too, not only under `-m gpu`."""
    from ember.kernels.paged import dot_in_fp16

    for decode in (True, False):
        case = _random_case("cpu", seed, decode=decode, fp8_scales=(0.5, 3.0), dtype=torch.bfloat16)
        assert dot_in_fp16(case.q, case.k_cache)
        want = case.reference()
        got = get_attention_backend("triton").forward(case.q, case.k, case.v, case.k_cache, case.v_cache,
                                                      case.meta, case.scale, case.k_scale, case.v_scale)
        torch.testing.assert_close(got.float(), want, **_tol("cuda"))


def test_fp8_scales_are_checked():
    k = torch.zeros(3, 2, 16)
    cache = torch.zeros(4, 4, 2, 16, dtype=FP8)
    slots = torch.zeros(3, dtype=torch.int64)
    with pytest.raises(ValueError, match="scale must be one float32"):
        kv_write(k, k, cache, cache, slots, k_scale=torch.ones(1, dtype=torch.float64))
    with pytest.raises(ValueError, match="scale must be one float32"):
        kv_write(k, k, cache, cache, slots, v_scale=torch.ones(2))
    with pytest.raises(ValueError, match="shapes disagree"):
        kv_write(k, k, cache, torch.zeros(4, 4, 2, 16), slots)
    with pytest.raises(ValueError, match="does not fit"):  # a cache neither in q's dtype nor fp8
        decode_attention(torch.zeros(2, 4, 16), *[torch.zeros(4, 4, 2, 16, dtype=torch.float16)] * 2,
                         torch.zeros(2, 1, dtype=torch.int32), torch.zeros(2, dtype=torch.int32), 1.0, 1)


# ---- sliding window and logit soft-capping --------------------------------------------------
#
# On the interpreter each launch is a hand-picked batch that puts many positions against the
# window at once: contexts shorter than, equal to and longer than W, a cached prefix longer
# than W, query blocks that start inside it and past it, windows inside one tile and across
# tiles, pages smaller than a tile (a table read per position) and holding whole tiles (one
# read a tile). Each windowed case first poisons what no query may see (Case.poison_unseen).


def _windowed_case(device: str, decode: bool, page: int, seed: int, fp8_scales=None, dtype=None) -> Case:
    if device == "cuda":  # Mistral/Gemma-like heads, contexts past the windows below
        rng = random.Random(seed)
        batch = 12
        cached = [rng.randint(0, 3000) for _ in range(batch)]
        new = [1] * batch if decode else [rng.randint(1, 700) for _ in range(batch)]
        if not decode:
            cached[0] = 0
        return Case(cached, new, 32, 8, 128, page, device, seed, fp8_scales, dtype)
    if decode:  # contexts 1, 7 and 8 (W and W + 1 for W = 7; 8 is one tile), 30, 63
        return Case([0, 6, 7, 29, 62], [1] * 5, 4, 1, 16, page, device, seed, fp8_scales, dtype)
    # a prompt of 20 (query blocks of 16 and 4), an extend of 9 over 37 cached, 3 over 5, a decode row at 16
    return Case([0, 37, 5, 15], [20, 9, 3, 1], 4, 2, 16, page, device, seed, fp8_scales, dtype)


def _gpu(*values, id):
    return pytest.param("cuda", *values, marks=pytest.mark.gpu, id=f"cuda-{id}")


def _cpu(*values, id):
    return pytest.param("cpu", *values, id=f"interpreter-{id}")


# device, window, softcap, page, tile
PREFILL_WINDOWS = [
    _cpu(5, None, 4, 8, id="w5-page4"),  # inside a tile, unaligned; a table read per position
    _cpu(16, 3.0, 8, 8, id="w16-cap3-page8"),  # two whole tiles, = one context, > two; one table read a tile
    _cpu(None, 2.0, 8, 8, id="cap2"),
    _gpu(1, None, 16, 64, id="w1"), _gpu(256, None, 16, 64, id="w256"), _gpu(1000, 50.0, 128, 64, id="w1000-cap50"),
    _gpu(4096, None, 128, 64, id="w4096"), _gpu(None, 50.0, 16, 64, id="cap50"),
    _gpu(64, 30.0, 128, 64, id="w64-cap30"),
]


def _caches(device: str) -> list:
    """The fp8 scales to run a windowed case with: the compute dtype's cache on the
    interpreter (its fp8 case is the backend test below, to keep CI short), and on CUDA a
    scaled fp8 cache too."""
    return [None, (0.5, 3.0)] if device == "cuda" else [None]


@pytest.mark.parametrize("device,window,softcap,page,tile", PREFILL_WINDOWS)
def test_prefill_window_and_softcap_match_reference(device, window, softcap, page, tile):
    for fp8_scales in _caches(device):
        case = _windowed_case(device, decode=False, page=page, seed=21, fp8_scales=fp8_scales)
        want = case.reference(window, softcap)
        if window is not None:
            assert case.poison_unseen(window) > 0 or window > max(case.cached)
        kv_write(case.k, case.v, case.k_cache, case.v_cache, case.meta.slot_mapping, **case.scales)
        got = prefill_attention(case.q, case.k_cache, case.v_cache, case.meta.block_tables,
                                case.meta.query_start_loc, case.meta.seq_lens, max(case.new), case.scale,
                                block_m=64 if device == "cuda" else 16, block_n=tile, **case.scales,
                                sliding_window=window, logit_softcap=softcap)
        torch.testing.assert_close(got.float(), want, **_tol(device), msg=lambda m: f"fp8 {fp8_scales}: {m}")


# device, window, softcap, page, tile, splits
DECODE_WINDOWS = [
    _cpu(1, None, 4, 8, (2,), id="w1"),  # the query sees itself: its own value row
    _cpu(7, None, 4, 8, (1, 3), id="w7-page4"),  # inside a tile; later splits empty
    _cpu(16, 3.0, 8, 8, (1, 4), id="w16-cap3-page8"),  # two tiles, split in tiles; the last split empty
    _cpu(1000, None, 8, 8, (3,), id="w1000"),
    _cpu(None, 2.0, 4, 8, (3,), id="cap2"),
    _gpu(1, None, 16, 64, (1, 8), id="w1"), _gpu(256, None, 16, 128, (1, 3, 32), id="w256"),
    _gpu(1000, 50.0, 128, 64, (1, 5, 32), id="w1000-cap50"), _gpu(4096, None, 128, 128, (1, 16), id="w4096"),
    _gpu(None, 50.0, 16, 128, (1, 32), id="cap50"), _gpu(100, 30.0, 128, 64, (1, 4, 32), id="w100-cap30"),
]


@pytest.mark.parametrize("device,window,softcap,page,tile,splits", DECODE_WINDOWS)
def test_decode_window_and_softcap_match_reference(device, window, softcap, page, tile, splits):
    """The splits cover only the window (the tiles before it are poisoned), however many."""
    for fp8_scales in _caches(device):
        case = _windowed_case(device, decode=True, page=page, seed=22, fp8_scales=fp8_scales)
        want = case.reference(window, softcap)
        if window is not None:
            assert case.poison_unseen(window) > 0 or window > max(case.cached)
        kv_write(case.k, case.v, case.k_cache, case.v_cache, case.meta.slot_mapping, **case.scales)
        for s in splits:
            got = decode_attention(case.q, case.k_cache, case.v_cache, case.meta.block_tables, case.meta.seq_lens,
                                   case.scale, num_splits=s, block_n=tile, **case.scales, sliding_window=window,
                                   logit_softcap=softcap)
            torch.testing.assert_close(got.float(), want, **_tol(device),
                                       msg=lambda m: f"{s} splits, fp8 {fp8_scales}: {m}")
        if window == 1 and fp8_scales is None:  # each head: its KV head's new value row, exactly
            heads, kv_heads = case.q.shape[1], case.k_cache.shape[2]
            torch.testing.assert_close(got, case.v.repeat_interleave(heads // kv_heads, 1), rtol=0, atol=0)


# device, chunk, page, tile, splits: Llama 4's chunked local attention (its chunk is 8192)
CHUNKS = [
    _cpu(8, 4, 8, (1, 3), id="c8-page4"),  # a chunk of one tile
    _cpu(12, 8, 8, (2,), id="c12-page8"),  # chunks across tiles, unaligned
    _cpu(1, 4, 8, (1,), id="c1"),  # each query sees itself
    _gpu(64, 16, 64, (1, 8), id="c64"), _gpu(1000, 16, 64, (1, 5, 32), id="c1000"),
    _gpu(2048, 128, 64, (1, 16), id="c2048"),
]


@pytest.mark.parametrize("device,chunk,page,tile,splits", CHUNKS)
def test_attention_chunks_match_reference(device, chunk, page, tile, splits):
    """Prefill and decode see their own chunk only; the tiles before the first new query's
    chunk are poisoned, so they must be skipped."""
    for decode in (False, True):
        case = _windowed_case(device, decode=decode, page=page, seed=25)
        want = case.reference(attention_chunk=chunk)
        assert case.poison_unseen(chunk=chunk) > 0
        kv_write(case.k, case.v, case.k_cache, case.v_cache, case.meta.slot_mapping)
        if not decode:
            got = prefill_attention(case.q, case.k_cache, case.v_cache, case.meta.block_tables,
                                    case.meta.query_start_loc, case.meta.seq_lens, max(case.new), case.scale,
                                    block_m=64 if device == "cuda" else 16, block_n=tile, attention_chunk=chunk)
            torch.testing.assert_close(got.float(), want, **_tol(device))
            continue
        for s in splits:
            got = decode_attention(case.q, case.k_cache, case.v_cache, case.meta.block_tables, case.meta.seq_lens,
                                   case.scale, num_splits=s, block_n=tile, attention_chunk=chunk)
            torch.testing.assert_close(got.float(), want, **_tol(device), msg=lambda m: f"{s} splits: {m}")


# the window a Gemma-like model gives its local layers, and the soft cap (Gemma 2's is 50; a
# small one bends these unit-variance scores harder)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [None, pytest.param(torch.bfloat16, id="bfloat16-queries")])
def test_triton_backend_window_and_softcap_over_scaled_fp8(device, dtype):
    """Through the backend over an fp8 cache with scales (k_scale folds into the score, before
    the cap): a mixed step (its leading decode row to flash-decoding, the rest to the prefill
    kernel) with a global layer and a windowed one in the
    same step, as Gemma alternates them, then a decode step. bfloat16 queries take the float16
    dots (DOT_FP16), on the interpreter too."""
    if dtype is not None and device == "cuda":
        pytest.skip("bfloat16 is CUDA's default dtype: the other case")
    tol = _tol("cuda") if dtype == torch.bfloat16 else _tol(device)
    window, cap = 11, 5.0
    backend = get_attention_backend("triton")
    case = Case([5, 0, 37, 60], [1, 20, 9, 1], 4, 2, 16, 8, device, seed=23, fp8_scales=(0.5, 3.0), dtype=dtype)
    want_global, want = case.reference(), case.reference(window, cap)
    if dtype is None:  # a global layer first: it reads the whole context
        got = backend.forward(case.q, case.k, case.v, case.k_cache, case.v_cache, case.meta, case.scale,
                              case.k_scale, case.v_scale)
        torch.testing.assert_close(got.float(), want_global, **tol)
    assert case.poison_unseen(window) > 0
    got = backend.forward(case.q, case.k, case.v, case.k_cache, case.v_cache, case.meta, case.scale, case.k_scale,
                          case.v_scale, sliding_window=window, logit_softcap=cap)
    torch.testing.assert_close(got.float(), want, **tol)

    dec = Case([3, 30, 47], [1, 1, 1], 4, 2, 16, 8, device, seed=24, fp8_scales=(0.5, 3.0), dtype=dtype)
    want = dec.reference(window, cap)
    assert dec.poison_unseen(window) > 0
    kv_write(dec.k, dec.v, dec.k_cache, dec.v_cache, dec.meta.slot_mapping, **dec.scales)
    got = decode_attention(dec.q, dec.k_cache, dec.v_cache, dec.meta.block_tables, dec.meta.seq_lens, dec.scale,
                           num_splits=3, block_n=64 if device == "cuda" else 8, **dec.scales, sliding_window=window,
                           logit_softcap=cap)
    torch.testing.assert_close(got.float(), want, **tol)


def test_window_and_softcap_are_checked():
    q, cache = torch.zeros(2, 4, 16), torch.zeros(4, 4, 2, 16)
    tables, lens = torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    starts = torch.tensor([0, 1, 2], dtype=torch.int32)
    for bad in (0, -3, 2.0, True):
        with pytest.raises(ValueError, match="sliding_window"):
            decode_attention(q, cache, cache, tables, lens, 1.0, 1, sliding_window=bad)
        with pytest.raises(ValueError, match="sliding_window"):
            prefill_attention(q, cache, cache, tables, starts, lens, 1, 1.0, sliding_window=bad)
    for bad in (0.0, -1.0, float("inf"), float("nan"), True):
        with pytest.raises(ValueError, match="logit_softcap"):
            decode_attention(q, cache, cache, tables, lens, 1.0, 1, logit_softcap=bad)
        with pytest.raises(ValueError, match="logit_softcap"):
            prefill_attention(q, cache, cache, tables, starts, lens, 1, 1.0, logit_softcap=bad)


# ---- any head dim: padded to a power of two inside the kernels ------------------------------
#
# Phi-2's 80 and Phi-3-mini's 96 (padded to 128), and multi-head latent attention's 576 (512 +
# 64 rope dims, padded to 1024) as ember runs it: multi-query attention over one KV head whose
# v_cache IS its k_cache. On the interpreter few heads and short contexts; on CUDA the models'
# own head counts (MLA: 16 and 128 query heads).

# id: (heads, kv_heads, head_dim, shared_kv) on the interpreter, on CUDA
HEAD_DIMS = {"phi2-80": ((4, 2, 80, False), (32, 32, 80, False)),
             "phi3-96": ((6, 2, 96, False), (32, 32, 96, False)),
             "mla-576": ((4, 1, 576, True), (16, 1, 576, True)),
             "d8": ((4, 2, 8, False), (8, 2, 8, False))}  # the least D: padded to 16, tl.dot's least K
HEAD_DIM_CASES = [pytest.param(device, name, id=f"{name}-{'interpreter' if device == 'cpu' else 'cuda'}",
                               marks=[pytest.mark.gpu] if device == "cuda" else [])
                  for device in ("cpu", "cuda") for name in HEAD_DIMS]


def _head_dim_case(device: str, name: str, decode: bool, seed: int, fp8_scales=None, dtype=None,
                   heads: int | None = None) -> Case:
    shape = HEAD_DIMS[name][device == "cuda"]
    if device == "cuda":
        cached, new = ([1, 700, 1500, 3000], [1] * 4) if decode else ([0, 700, 1300, 40], [300, 129, 1, 77])
        page = 16
    else:  # a prompt of 21 (query blocks of 16 and 5), an extend over 13 cached, a decode row at 30
        cached, new = ([1, 17, 40], [1, 1, 1]) if decode else ([0, 13, 30], [21, 5, 1])
        page = 8
    return Case(cached, new, heads or shape[0], *shape[1:3], page, device, seed, fp8_scales, dtype, shared_kv=shape[3])


@pytest.mark.parametrize("device,name", HEAD_DIM_CASES)
@pytest.mark.parametrize("fp8_scales", [None, pytest.param((0.5, 0.5), id="fp8")])
def test_kv_write_at_any_head_dim(device, name, fp8_scales):
    """The same bytes as the reference's write, k_cache and v_cache one tensor or two (one
    k_scale = v_scale for one plane: a row holds one quantization)."""
    case = _head_dim_case(device, name, decode=False, seed=30, fp8_scales=fp8_scales)
    want_k, want_v = case.k_cache.clone(), case.v_cache.clone()
    write_kv(case.k, case.v, want_k, want_v, case.meta.slot_mapping, **case.scales)
    kv_write(case.k, case.v, case.k_cache, case.v_cache, case.meta.slot_mapping, **case.scales)
    assert torch.equal(_bits(case.k_cache), _bits(want_k)) and torch.equal(_bits(case.v_cache), _bits(want_v))


@pytest.mark.parametrize("device,name", HEAD_DIM_CASES)
@pytest.mark.parametrize("pack_gqa", [False, True], ids=["by-head", "gqa-packed"])
def test_prefill_at_any_head_dim(device, name, pack_gqa):
    """Prefill, an extend and a decode row through the prefill kernel at the tiles it takes
    for the dim on CUDA (prefill_tiles); the padded dims of q's rows hold junk that must not
    leak in (q is a view of a wider tensor)."""
    case = _head_dim_case(device, name, decode=False, seed=31)
    want = case.reference()
    kv_write(case.k, case.v, case.k_cache, case.v_cache, case.meta.slot_mapping)
    tokens, heads, dim = case.q.shape
    wide = torch.full((tokens, heads, dim + 16), float("nan"), dtype=case.q.dtype, device=case.q.device)
    wide[..., :dim] = case.q
    tiles = dict(block_m=16, block_n=16) if device == "cpu" else {}
    got = prefill_attention(wide[..., :dim], case.k_cache, case.v_cache, case.meta.block_tables,
                            case.meta.query_start_loc, case.meta.seq_lens, max(case.new), case.scale,
                            pack_gqa=pack_gqa, **tiles)
    torch.testing.assert_close(got.float(), want, **_tol(device))


@pytest.mark.parametrize("device,name", HEAD_DIM_CASES)
def test_decode_at_any_head_dim(device, name):
    """One split (the output written directly) and several (merged); the output's rows sit in
    a wider tensor whose padding columns must stay untouched."""
    case = _head_dim_case(device, name, decode=True, seed=32)
    want = case.reference()
    kv_write(case.k, case.v, case.k_cache, case.v_cache, case.meta.slot_mapping)
    batch, heads, dim = case.q.shape
    for s in [1, 3] if device == "cpu" else [1, 5, num_decode_splits(batch, case.k_cache.shape[2])]:
        wide = torch.full((batch, heads, dim + 16), 7.0, dtype=case.q.dtype, device=case.q.device)
        got = decode_attention(case.q, case.k_cache, case.v_cache, case.meta.block_tables, case.meta.seq_lens,
                               case.scale, num_splits=s, out=wide[..., :dim],
                               **(dict(block_n=16) if device == "cpu" else {}))
        torch.testing.assert_close(got.float(), want, **_tol(device), msg=lambda m: f"{s} splits: {m}")
        assert torch.all(wide[..., dim:] == 7.0)


@pytest.mark.parametrize("device", DEVICES)
def test_decode_cuts_a_wide_group_into_head_blocks(device):
    """MLA's many query heads over one KV head of D 576 (padded to 1024): a program takes 16
    heads at a time (head_blocks), the last block partly masked (20 heads: 16 + 4; 128: 8 x
    16), each block over the same splits."""
    from ember.kernels.decode_attention import head_blocks

    heads = 20 if device == "cpu" else 128
    assert head_blocks(heads, 1024) == (16, -(-heads // 16)) and head_blocks(8, 128) == (16, 1)
    case = _head_dim_case(device, "mla-576", decode=True, seed=33, heads=heads)
    want = case.reference()
    kv_write(case.k, case.v, case.k_cache, case.v_cache, case.meta.slot_mapping)
    for s in (1, 3):
        got = decode_attention(case.q, case.k_cache, case.v_cache, case.meta.block_tables, case.meta.seq_lens,
                               case.scale, num_splits=s, **(dict(block_n=16) if device == "cpu" else {}))
        torch.testing.assert_close(got.float(), want, **_tol(device), msg=lambda m: f"{s} splits: {m}")


@pytest.mark.parametrize("device,name", [p for p in HEAD_DIM_CASES if p.values[0] == "cuda"
                                         or p.values[1] == "mla-576"])  # the interpreter: MLA's, padded most
def test_triton_backend_at_any_head_dim_over_fp8(device, name):
    """The backend at its own tiles and configs: a mixed step (its leading decode rows to
    flash-decoding, the rest to the prefill kernel) over a scaled fp8 cache (MLA: one scale
    for its one plane), a windowed and soft-capped layer on the same step, then (CUDA) a
    decode step."""
    backend = get_attention_backend("triton")
    scales = (0.5, 0.5) if HEAD_DIMS[name][0][3] else (0.5, 3.0)
    shape = HEAD_DIMS[name][device == "cuda"]
    lens = ([5, 60, 0, 37], [1, 1, 20, 9]) if device == "cpu" else ([5, 900, 0, 1700], [1, 1, 300, 90])
    case = Case(*lens, *shape[:3], 8 if device == "cpu" else 16, device, seed=34, fp8_scales=scales,
                shared_kv=shape[3])
    want, want_windowed = case.reference(), case.reference(11, 5.0)
    got = backend.forward(case.q, case.k, case.v, case.k_cache, case.v_cache, case.meta, case.scale, case.k_scale,
                          case.v_scale)
    assert backend.plan(case.meta, shape[1]).decode_rows == 2
    torch.testing.assert_close(got.float(), want, **_tol(device))
    got = backend.forward(case.q, case.k, case.v, case.k_cache, case.v_cache, case.meta, case.scale, case.k_scale,
                          case.v_scale, kv_written=True, sliding_window=11, logit_softcap=5.0)
    torch.testing.assert_close(got.float(), want_windowed, **_tol(device))
    if device == "cpu":
        return  # the decode kernel's own test above
    dec = _head_dim_case(device, name, decode=True, seed=35, fp8_scales=scales)
    want = dec.reference()
    got = backend.forward(dec.q, dec.k, dec.v, dec.k_cache, dec.v_cache, dec.meta, dec.scale, dec.k_scale,
                          dec.v_scale)
    torch.testing.assert_close(got.float(), want, **_tol(device))


def test_head_dim_is_checked():
    q, cache = torch.zeros(2, 4, 6), torch.zeros(4, 4, 2, 6)
    tables, lens = torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="head_dim must be at least 8"):
        decode_attention(q, cache, cache, tables, lens, 1.0, 1)
    with pytest.raises(ValueError, match="head_dim must be at least 8"):
        prefill_attention(q, cache, cache, tables, torch.tensor([0, 1, 2], dtype=torch.int32), lens, 1, 1.0)


# ---- multi-head latent attention's decode kernel --------------------------------------------
#
# kernels/mla_decode.py against MLA decode written out in plain torch over the paged latent
# cache. On the interpreter a small latent (64 + 16 rope dims) at 16 heads and at 20 (not a
# multiple of a head block), and once DeepSeek's 512 + 64; on CUDA DeepSeek-V2-Lite's shape
# (512 + 64, 16 heads) and V3's (128 heads). Contexts of 1, of a page, and not a multiple of
# the page or the tile, in shuffled blocks; pages smaller than a tile (a table read per
# position) and holding whole tiles.


def mla_reference(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                  scale: float, latent_dim: int, k_scale: torch.Tensor | None = None,
                  v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """In float64, each sequence b: its rows [c | k_pe] gathered position by position
    (cache[block_tables[b, p // page], p % page]; fp8 read back times its scale), then
    softmax_p(scale * q_h . row_p) times the rows' c. [B, H, latent_dim]; no context: 0."""
    page, dim = cache.shape[1], cache.shape[-1]
    flat = cache.cpu().view(-1, dim).float().double()
    ks, vs = (1.0 if s is None else s.item() for s in (k_scale, v_scale))
    out = torch.zeros(q.shape[0], q.shape[1], latent_dim, dtype=torch.float64)
    for b, n in enumerate(seq_lens.tolist()):
        pos = torch.arange(n)
        rows = flat[block_tables[b].cpu().long()[pos // page] * page + pos % page]
        if n:
            probs = (q[b].cpu().double() @ (rows * ks).T * scale).softmax(-1)
            out[b] = probs @ (rows[:, :latent_dim] * vs)
    return out


def _mla_case(device: str, lens: list[int], heads: int, latent: int, rope: int, page: int, seed: int,
              dtype: torch.dtype, fp8_scales=None) -> Case:
    """A decode step's sequences of lens[i] tokens (the last one new, written by kv_write) over one latent plane."""
    case = Case([n - 1 for n in lens], [1] * len(lens), heads, 1, latent + rope, page, device, seed, fp8_scales,
                dtype, shared_kv=True)
    kv_write(case.k, case.v, case.k_cache, case.v_cache, case.meta.slot_mapping, **case.scales)
    return case


def _mla_tol(dtype: torch.dtype) -> dict:
    """float32: the kernel's float32 sums (3e-7 seen on the interpreter); bfloat16: its
    probabilities and output rounded to bfloat16 (up to 0.01 seen at outputs near 1)."""
    return dict(atol=2e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)


# device, heads, latent dims, rope dims
MLA_SHAPES = [_cpu(16, 64, 16, id="h16-64+16"), _cpu(20, 64, 16, id="h20-64+16"), _cpu(16, 512, 64, id="h16-512+64"),
              _gpu(16, 512, 64, id="v2-lite"), _gpu(128, 512, 64, id="v3")]


@pytest.mark.parametrize("device,heads,latent,rope", MLA_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_mla_decode_matches_reference(device, heads, latent, rope, dtype):
    """One split (the output written directly) and several (merged); on the interpreter the
    default head block (20 heads: one of 32, 12 rows masked) and blocks of 16 (16 + 4); pages
    of half a tile and of two tiles."""
    if device == "cuda" and dtype == torch.float32:
        pytest.skip("CUDA's tl.dot takes float32 as tf32: bfloat16 is the model dtype there")
    if device == "cpu" and latent == 512 and dtype == torch.bfloat16:
        pytest.skip("the interpreter's time: DeepSeek's dims once, in float32")
    if device == "cpu":  # (splits, block_h)
        lens, pages, runs, tile = [1, 8, 17, 45], (8, 32), [(1, None), (3, 16)], 16
    else:
        lens, pages, tile = [1, 700, 1500, 3000, 129, 2049], (16, 128), None
        runs = [(s, None) for s in (1, 5, num_decode_splits(len(lens), mla_head_blocks(heads)))]
    for page in pages:
        case = _mla_case(device, lens, heads, latent, rope, page, seed=40 + page, dtype=dtype)
        want = mla_reference(case.q, case.k_cache, case.meta.block_tables, case.meta.seq_lens, case.scale, latent)
        for s, block_h in runs:
            got = mla_decode(case.q, case.k_cache, case.meta.block_tables, case.meta.seq_lens, case.scale, latent, s,
                             block_h=block_h, block_n=tile)
            assert got.shape == (len(lens), heads, latent) and got.dtype == dtype
            torch.testing.assert_close(got.cpu().double(), want, **_mla_tol(dtype),
                                       msg=lambda m: f"page {page}, {s} splits, block_h {block_h}: {m}")


@pytest.mark.parametrize("device,heads,latent,rope", [p for p in MLA_SHAPES if p.id != "interpreter-h16-512+64"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_mla_decode_over_fp8_matches_reference(device, heads, latent, rope, dtype):
    """An fp8 cache with a scale (one plane: one k_scale = v_scale, as the runner gives it);
    bfloat16 queries take the float16 dots (DOT_FP16), on the interpreter too."""
    if device == "cuda" and dtype == torch.float32:
        pytest.skip("CUDA's tl.dot takes float32 as tf32: bfloat16 is the model dtype there")
    lens = [1, 13, 40] if device == "cpu" else [1, 900, 2100, 3000]
    case = _mla_case(device, lens, heads, latent, rope, 8 if device == "cpu" else 128, seed=41, dtype=dtype,
                     fp8_scales=(0.5, 0.5))
    want = mla_reference(case.q, case.k_cache, case.meta.block_tables, case.meta.seq_lens, case.scale, latent,
                         **case.scales)
    for s in (1, 3):
        got = mla_decode(case.q, case.k_cache, case.meta.block_tables, case.meta.seq_lens, case.scale, latent, s,
                         **case.scales, block_n=16 if device == "cpu" else None)
        torch.testing.assert_close(got.cpu().double(), want, **_mla_tol(dtype), msg=lambda m: f"{s} splits: {m}")


@pytest.mark.parametrize("device", DEVICES)
def test_mla_decode_padding_rows_and_output_views(device):
    """A CUDA graph's padded rows (seq_len 0) give 0, not NaN; the output may be a view into
    a wider buffer (the backend's mixed step), whose other columns stay untouched."""
    dtype = _dtype(device)
    case = _mla_case(device, [5, 30, 12], 16, 64, 16, 8, seed=42, dtype=dtype)
    lens = case.meta.seq_lens.clone()
    lens[1] = 0
    want = mla_reference(case.q, case.k_cache, case.meta.block_tables, lens, case.scale, 64)
    for s in (1, 2):
        wide = torch.full((3, 16, 80), 7.0, dtype=dtype, device=device)
        got = mla_decode(case.q, case.k_cache, case.meta.block_tables, lens, case.scale, 64, s, out=wide[..., :64],
                         block_n=16)
        assert torch.all(got[1] == 0) and not got.isnan().any() and torch.all(wide[..., 64:] == 7.0)
        torch.testing.assert_close(got.cpu().double(), want, **_mla_tol(dtype))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp8_scales", [None, pytest.param((0.5, 0.5), id="fp8")])
def test_triton_backend_runs_mla_decode_rows(device, fp8_scales):
    """The backend with value_dim: a decode step, a mixed step whose leading decode rows go to
    mla_decode (the rest to the prefill kernel, its latent dims kept), and deterministic mode
    (every row to the prefill kernel): [T, H, latent] equal to the torch backend's."""
    latent, rope, heads = (64, 16, 4) if device == "cpu" else (512, 64, 16)
    # (cached, new), deterministic mode, (plan.decode, plan.decode_rows)
    steps = [(([0, 11, 40], [1, 1, 1]), False, (True, 0)), (([5, 30, 0, 17], [1, 1, 12, 3]), False, (False, 2)),
             (([5, 30, 0, 17], [1, 1, 12, 3]), True, (False, 0))]
    if device == "cuda":
        steps = [(([0, 900, 1700], [1, 1, 1]), *rest) if i == 0 else (([5, 900, 0, 1700], [1, 1, 300, 90]), *rest)
                 for i, (_, *rest) in enumerate(steps)]
    for (cached, new), invariant, routes in steps:
        case = Case(cached, new, heads, 1, latent + rope, 8 if device == "cpu" else 16, device, seed=43,
                    fp8_scales=fp8_scales, shared_kv=True)
        want = case.reference()[..., :latent]
        backend = get_attention_backend("triton")
        backend.batch_invariant = invariant
        got = backend.forward(case.q, case.k, case.v, case.k_cache, case.v_cache, case.meta, case.scale,
                              case.k_scale, case.v_scale, value_dim=latent)
        plan = backend.plan(case.meta, mla_head_blocks(heads))
        assert (plan.decode, plan.decode_rows) == routes and got.shape == (sum(new), heads, latent)
        torch.testing.assert_close(got.float(), want, **_tol(device), msg=lambda m: f"{new}, {invariant}: {m}")


def test_mla_decode_checks_layouts():
    q, cache = torch.zeros(2, 4, 80), torch.zeros(4, 8, 1, 80)
    tables, lens = torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="does not fit a latent cache"):
        mla_decode(q, torch.zeros(4, 8, 2, 80), tables, lens, 1.0, 64, 1)
    with pytest.raises(ValueError, match="at least 8 dims"):
        mla_decode(q, cache, tables, lens, 1.0, 76, 1)
    with pytest.raises(ValueError, match="int32"):
        mla_decode(q, cache, tables.long(), lens, 1.0, 64, 1)
    with pytest.raises(ValueError, match="out must be"):
        mla_decode(q, cache, tables, lens, 1.0, 64, 1, out=torch.zeros(2, 4, 80))
    backend = get_attention_backend("triton")
    meta = AttentionMetadata(torch.zeros(2, dtype=torch.int64), torch.tensor([0, 1, 2], dtype=torch.int32), lens,
                             tables, [1, 1], [1, 1])
    k = torch.zeros(2, 1, 80)
    with pytest.raises(ValueError, match="k_cache must be v_cache"):
        backend.forward(q, k, k, cache, cache.clone(), meta, 1.0, value_dim=64)
    with pytest.raises(ValueError, match="no sliding window"):
        backend.forward(q, k, k, cache, cache, meta, 1.0, sliding_window=4, value_dim=64)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp8", [False, True], ids=["cache-dtype", "cache-fp8"])
def test_mla_expanded_prefill_on_the_triton_backend(device, fp8):
    """MLA's non-absorbed prefill (models/mla.py) at DeepSeek's head dims (keys 128 + 64 = 192,
    values 128) on a mixed step: a decode row (absorbed, mla_decode), a prefill and a chunk over
    a cached prefix, the last two over the expanded keys and values in their synthetic blocks
    through the prefill kernel. The layer on the Triton backend equals the same layer, absorbed
    throughout, on the torch backend; over an fp8 cache (a scale of 0.5) the expanded path
    dequantizes the gathered latents as the absorbed one reads them."""
    from ember.layers.rotary import RotaryEmbedding
    from ember.models.config import ModelConfig
    from ember.models.mla import LatentAttention

    torch.manual_seed(0)
    heads, rank, block = (2, 32, 8) if device == "cpu" else (16, 512, 16)
    cfg = ModelConfig.from_hf_config({
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "vocab_size": 64,
        "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": heads,
        "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "kv_lora_rank": rank, "q_lora_rank": None,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 4,
        "num_experts_per_tok": 2, "moe_intermediate_size": 16, "rope_theta": 10000.0})
    dtype = _dtype(device)
    cached, new = [6, 0, 11], [1, 13, 5]  # a decode row leads
    lens = [c + n for c, n in zip(cached, new)]
    per_seq = -(-max(lens) // block)
    tables = torch.randperm(len(lens) * per_seq).view(len(lens), per_seq).int()
    slots = [tables[i, p // block].item() * block + p % block for i in range(len(lens)) for p in range(lens[i])]
    new_slots = [s for i, n in enumerate(new) for s in slots[sum(lens[:i]) + cached[i]:sum(lens[:i + 1])]]
    positions = torch.tensor([p for c, n in zip(cached, new) for p in range(c, c + n)], device=device)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(new_slots, device=device),
        query_start_loc=torch.tensor([0, 1, 14, 19], dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device), block_tables=tables.to(device),
        query_lens_cpu=new, seq_lens_cpu=lens)
    rope = RotaryEmbedding(64, 128, 10000.0, None).to(device).lookup(positions)
    weights = LatentAttention(cfg, get_attention_backend("torch")).state_dict()
    for w in weights.values():
        w.normal_(std=0.1)
    x = torch.randn(sum(new), 64, dtype=dtype, device=device)
    cache = torch.randn(len(lens) * per_seq, block, 1, rank + 64, dtype=dtype, device=device)
    if fp8:
        cache = quantize_kv(cache, FP8, torch.tensor([0.5], device=device))
    outs = []
    for name, expanded in (("torch", False), ("triton", True)):
        layer = LatentAttention(cfg, get_attention_backend(name))
        layer.load_state_dict(weights)
        layer.to(device, dtype).expanded_prefill = expanded
        # the cache's scales stay one float32 each, as the runner keeps them (.to(dtype) casts buffers too)
        layer.k_scale, layer.v_scale = (torch.full((1,), 0.5 if fp8 else 1.0, device=device) for _ in range(2))
        layer.k_cache = layer.v_cache = cache.clone()
        step = AttentionMetadata(**{f: getattr(meta, f) for f in ("slot_mapping", "query_start_loc", "seq_lens",
                                                                   "block_tables", "query_lens_cpu", "seq_lens_cpu")},
                                 eager=True)
        outs.append(layer(rope.clone(), x, step))
        assert (step.plans.get("mla-expanded") is not None) == expanded
        if expanded:
            assert step.plans["mla-expanded"].decode_tokens == 1
    got, want = outs[1].float(), outs[0].float()
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, **_tol(device))
    else:  # bf16: the two forms round at different places (q W_UK against W_UK c): compare in bulk, a wrong head
        # or offset is off by the values' own size
        diff = (got - want).abs()
        print(f"mla expanded vs absorbed in bf16: mean |diff| {diff.mean():.4f}, max {diff.max():.4f}, "
              f"mean |value| {want.abs().mean():.4f}")
        assert diff.mean() <= 0.03 * want.abs().mean() and diff.max() <= 0.25 * want.abs().max()
