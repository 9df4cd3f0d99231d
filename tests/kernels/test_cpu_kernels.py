"""The C++ CPU kernels (ember/kernels/cpu) against the plain-torch code they replace, which
runs inside `cpu_kernels.disabled()`."""

from __future__ import annotations

import math

import pytest
import torch

from ember.kernels import cpu as cpu_kernels
from ember.layers.activation import silu_and_mul
from ember.layers.attention import AttentionMetadata
from ember.layers.attention.torch_ref import TorchReferenceBackend, _matmul_attention, context_blocks
from ember.layers.norm import RMSNorm
from ember.layers.rotary import RotaryEmbedding, apply_rotary

DTYPES = [torch.float32, torch.bfloat16]


def tolerance(dtype: torch.dtype) -> dict:
    # float32: the sums run in another order; bfloat16: at most one rounding step apart
    return {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}


def test_the_library_builds_here():
    """CI's machine has a compiler: a build that breaks must fail here, not fall back quietly."""
    ops = cpu_kernels.ops()
    assert ops is not None
    x = torch.randn(2, 8)
    assert cpu_kernels.for_tensor(x) is ops
    assert cpu_kernels.for_tensor(x.to(torch.int32)) is None
    with cpu_kernels.disabled():
        assert cpu_kernels.for_tensor(x) is None
    assert cpu_kernels.for_tensor(x) is ops


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", [64, 576, 1000])
def test_rms_norm_with_and_without_residual(dtype, size):
    g = torch.Generator().manual_seed(size)
    norm = RMSNorm(size, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(size, generator=g))
    x = torch.randn(7, size, generator=g).to(dtype)
    residual = torch.randn(7, size, generator=g).to(dtype)
    with cpu_kernels.disabled():
        want = norm(x)
        want_y, want_residual = norm(x, residual.clone())
    torch.testing.assert_close(norm(x), want, **tolerance(dtype))
    got_residual = residual.clone()
    got_y, returned = norm(x, got_residual)
    assert returned is got_residual  # updated in place, as on CUDA
    assert torch.equal(got_residual, want_residual)  # one rounded add: exact
    torch.testing.assert_close(got_y, want_y, **tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_per_head_on_a_strided_view(dtype):
    """Qwen3's q/k norm runs on [tokens, heads, head_dim] views of the fused qkv output."""
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(5, 4 * 32 + 2 * 2 * 32, generator=g).to(dtype)
    q = qkv[:, :128].view(5, 4, 32)
    norm = RMSNorm(32, 1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(32, generator=g) + 0.5)
    with cpu_kernels.disabled():
        want = norm(q)
    got = norm(q)
    assert got.shape == (5, 4, 32)
    torch.testing.assert_close(got, want, **tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_rope_and_activation_give_a_row_the_same_bits_in_calls_of_any_size(dtype):
    """Batch invariance of the per-row kernels: rows of 1, 7, 16 and 33 from a batch of 512,
    at any offset, come out as in the one call over all 512."""
    g = torch.Generator().manual_seed(4)
    norm = RMSNorm(576, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(576, generator=g) + 0.5)
    rotary = RotaryEmbedding(64, 4096, 10000.0, None)
    x = torch.randn(512, 576, generator=g).to(dtype)
    gate_up = torch.randn(512, 2 * 1536, generator=g).to(dtype)
    positions = torch.randint(0, 4096, (512,), generator=g)
    qk = torch.randn(512, 12, 64, generator=g).to(dtype)

    def rope(rows):
        q, k = qk[rows, :9].clone(), qk[rows, 9:].clone()
        return torch.cat(apply_rotary(q, k, rotary.lookup(positions[rows]))[:2], dim=1)

    whole = (norm(x), silu_and_mul(gate_up), rope(slice(0, 512)))
    for size in (1, 7, 16, 33):
        for start in (0, 3, 479):
            rows = slice(start, start + size)
            assert torch.equal(norm(x[rows]), whole[0][rows])
            assert torch.equal(silu_and_mul(gate_up[rows]), whole[1][rows])
            assert torch.equal(rope(rows), whole[2][rows])


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    x = (torch.randn(9, 2 * 1536, generator=torch.Generator().manual_seed(2)) * 4).to(dtype)
    with cpu_kernels.disabled():
        want = silu_and_mul(x)
    torch.testing.assert_close(silu_and_mul(x), want, **tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rotary_dim", [64, 48], ids=["whole_head", "partial"])
def test_rope_rotates_qkv_views_in_place(dtype, rotary_dim):
    """Partial RoPE (48 of 64 dims, as Phi-4-mini's 3/4) leaves the last 16 dims of each head."""
    g = torch.Generator().manual_seed(3)
    heads, kv_heads, dim, tokens = 9, 3, 64, 11
    rotary = RotaryEmbedding(rotary_dim, 4096, 10000.0, None)
    positions = torch.randint(0, 4096, (tokens,), generator=g)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g).to(dtype)
    v_before = qkv[:, (heads + kv_heads) * dim:].clone()

    def views(t):
        return t[:, :heads * dim].view(tokens, heads, dim), t[:, heads * dim:(heads + kv_heads) * dim].view(
            tokens, kv_heads, dim)

    with cpu_kernels.disabled():
        want_q, want_k, _ = apply_rotary(*views(qkv.clone()), rotary.lookup(positions))
    q, k = views(qkv)
    got_q, got_k, _ = apply_rotary(q, k, rotary.lookup(positions))
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()  # in place
    torch.testing.assert_close(got_q, want_q, **tolerance(dtype))
    torch.testing.assert_close(got_k, want_k, **tolerance(dtype))
    assert torch.equal(qkv[:, (heads + kv_heads) * dim:], v_before)  # v untouched
    assert torch.equal(got_q[..., rotary_dim:], want_q[..., rotary_dim:])  # the passed dims, bit for bit
    assert torch.equal(got_k[..., rotary_dim:], want_k[..., rotary_dim:])


def plain_decode(q, k_cache, v_cache, tables, lens, scale, window=None, softcap=None):
    block_size = k_cache.shape[1]
    length = -(-int(lens.max()) // block_size) * block_size
    keys = torch.arange(length)[None, :]
    mask = keys < lens[:, None]
    if window is not None:  # the query at lens - 1 sees keys lens - W .. lens - 1
        mask &= keys >= lens[:, None] - window
    return _matmul_attention(q.float()[:, None], context_blocks(k_cache, tables, length).float(),
                             context_blocks(v_cache, tables, length).float(), mask[:, None, None, :], scale,
                             softcap)[:, 0]


def decode(q, k_cache, v_cache, tables, lens, scale, window=0, softcap=0.0):
    """paged_attention with one query row a sequence."""
    starts = torch.arange(len(lens) + 1, dtype=torch.int32)
    return cpu_kernels.ops().paged_attention(q, k_cache, v_cache, tables, starts, lens, scale, window, softcap)


def decode_case(dtype, heads, kv_heads, dim, seed, lens):
    """Shuffled block tables (16-token blocks), q a strided view of a fused qkv row."""
    g = torch.Generator().manual_seed(seed)
    block_size, num_blocks = 16, 64
    lens = torch.tensor(lens, dtype=torch.int32)
    batch, width = len(lens), -(-int(lens.max()) // block_size)
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=g).to(dtype)
    tables = torch.randperm(num_blocks, generator=g)[: batch * width].view(batch, width).to(torch.int32)
    qkv = torch.randn(batch, (heads + 2 * kv_heads) * dim, generator=g).to(dtype)
    return qkv[:, : heads * dim].view(batch, heads, dim), k_cache, v_cache, tables, lens


@pytest.mark.parametrize("dtype", DTYPES + [torch.float16])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 4, 16), (8, 2, 128), (6, 1, 40)])
@pytest.mark.parametrize("seed", [0, 1])
def test_paged_attention_decode_matches_plain_torch(dtype, heads, kv_heads, dim, seed):
    """Shuffled block tables, lengths on and off block boundaries (1, 16, 17, ...), q a
    strided view of a fused qkv row, padded table columns pointing at garbage blocks."""
    q, k_cache, v_cache, tables, lens = decode_case(dtype, heads, kv_heads, dim, seed,
                                                    [1, 16, 17, 100, 47, 160][: 4 + seed * 2])
    batch = len(lens)
    scale = 1 / math.sqrt(dim)
    got = decode(q, k_cache, v_cache, tables, lens, scale)
    want = plain_decode(q, k_cache, v_cache, tables, lens, scale)
    assert got.dtype == dtype and got.shape == (batch, heads, dim)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
    torch.testing.assert_close(got.float(), want, **tol)
    # one token of context: the output is that token's value row, whatever the query
    first = v_cache[tables[0, 0], 0].float().repeat_interleave(heads // kv_heads, 0)
    torch.testing.assert_close(got[0].float(), first, **tol)


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (6, 1, 40)])
def test_paged_attention_reads_a_half_cache_under_float32_queries(cache_dtype, heads, kv_heads, dim):
    """The GGUF-block path's float16 cache (llama.cpp's default type): the float32 math on
    the cache's values as they are stored."""
    q, k_cache, v_cache, tables, lens = decode_case(torch.float32, heads, kv_heads, dim, 3, [1, 16, 17, 100, 47])
    k_cache, v_cache = k_cache.to(cache_dtype), v_cache.to(cache_dtype)
    scale = 1 / math.sqrt(dim)
    got = decode(q, k_cache, v_cache, tables, lens, scale)
    want = plain_decode(q, k_cache.float(), v_cache.float(), tables, lens, scale)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_rotary_writes_k_and_v_into_the_cache_as_it_turns(cache_dtype):
    """rotary_inplace with the cache: k rotated in place as without it, then k and v stored
    at their slots, rounded to the cache's dtype as .to() rounds; every other slot untouched."""
    g = torch.Generator().manual_seed(2)
    rope = RotaryEmbedding(16, 64, 10000.0, None)
    qkv = torch.randn(3, (4 + 2 + 2) * 16, generator=g)
    q, k, v = (t.reshape(3, -1, 16) for t in qkv.split([64, 32, 32], dim=1))
    q_ref, k_ref = q.clone(), k.clone()
    positions = torch.tensor([0, 5, 9])
    ops = cpu_kernels.ops()
    ops.rotary_inplace(q_ref, k_ref, rope.lookup(positions))
    k_cache = torch.full((4, 4, 2, 16), 7.0).to(cache_dtype)
    v_cache = torch.full((4, 4, 2, 16), 7.0).to(cache_dtype)
    slots = torch.tensor([13, 2, 6])
    ops.rotary_inplace(q, k, rope.lookup(positions), v, k_cache, v_cache, slots)
    assert torch.equal(q, q_ref) and torch.equal(k, k_ref)
    flat_k, flat_v = k_cache.view(-1, 2, 16), v_cache.view(-1, 2, 16)
    assert torch.equal(flat_k[slots], k_ref.to(cache_dtype)) and torch.equal(flat_v[slots], v.to(cache_dtype))
    others = torch.ones(16, dtype=torch.bool)
    others[slots] = False
    assert (flat_k[others] == 7).all() and (flat_v[others] == 7).all()
    with pytest.raises(RuntimeError, match="slot 16 is not in the cache"):
        ops.rotary_inplace(q, k, rope.lookup(positions), v, k_cache, v_cache, torch.tensor([13, 2, 16]))


# (window, softcap): a window of one key (the query's own), one block, one block and a key,
# inside a block, past every context; caps that bend these scores hard and gently
WINDOW_SOFTCAP = [(1, None), (16, None), (17, 30.0), (5, None), (1000, 5.0), (None, 2.0), (40, 50.0)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (6, 1, 40)])
@pytest.mark.parametrize("window,softcap", WINDOW_SOFTCAP)
def test_paged_attention_with_window_and_softcap(dtype, heads, kv_heads, dim, window, softcap):
    """Against the plain-torch matmuls with the window's mask and the cap. The keys before a
    window are NaN in the cache: the kernel must not read them (reading only the window is
    what makes it fast)."""
    q, k_cache, v_cache, tables, lens = decode_case(dtype, heads, kv_heads, dim, 7, [1, 16, 17, 100, 47, 160])
    scale = 1 / math.sqrt(dim)
    want = plain_decode(q, k_cache, v_cache, tables, lens, scale, window, softcap)
    if window is not None:
        block_size = k_cache.shape[1]
        for b, n in enumerate(lens.tolist()):
            for t in range(max(0, n - window)):
                k_cache[tables[b, t // block_size], t % block_size] = float("nan")
                v_cache[tables[b, t // block_size], t % block_size] = float("nan")
    got = decode(q, k_cache, v_cache, tables, lens, scale, window or 0, softcap or 0.0)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
    torch.testing.assert_close(got.float(), want, **tol)
    if window == 1:  # the query sees its own key only: its value row, whatever the scores
        last = torch.stack([v_cache[tables[b, (n - 1) // 16], (n - 1) % 16] for b, n in enumerate(lens.tolist())])
        assert torch.equal(got, last.repeat_interleave(heads // kv_heads, 1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 5])
def test_paged_attention_with_sinks(dtype, window):
    """gpt-oss's attention sinks: each head's logit joins the softmax's denominator (a key of
    no value), against the plain-torch matmuls with the sink column; sinks far below every
    score change nothing, one far above drives the output to zero."""
    heads, kv_heads, dim = 8, 2, 64
    q, k_cache, v_cache, tables, lens = decode_case(dtype, heads, kv_heads, dim, 5, [1, 16, 17, 100, 47])
    scale, starts = 1 / math.sqrt(dim), torch.arange(len(lens) + 1, dtype=torch.int32)
    sinks = torch.linspace(-2.0, 3.0, heads)
    block_size = k_cache.shape[1]
    length = -(-int(lens.max()) // block_size) * block_size
    keys = torch.arange(length)[None, :]
    mask = keys < lens[:, None]
    if window is not None:
        mask &= keys >= lens[:, None] - window
    want = _matmul_attention(q.float()[:, None], context_blocks(k_cache, tables, length).float(),
                             context_blocks(v_cache, tables, length).float(), mask[:, None, None, :], scale, None,
                             sinks)[:, 0]
    got = cpu_kernels.ops().paged_attention(q, k_cache, v_cache, tables, starts, lens, scale, window or 0, 0.0,
                                            None, None, sinks)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
    torch.testing.assert_close(got.float(), want, **tol)
    plain = decode(q, k_cache, v_cache, tables, lens, scale, window or 0)
    low = cpu_kernels.ops().paged_attention(q, k_cache, v_cache, tables, starts, lens, scale, window or 0, 0.0,
                                            None, None, torch.full((heads,), -1e4))
    assert torch.equal(low, plain)
    high = cpu_kernels.ops().paged_attention(q, k_cache, v_cache, tables, starts, lens, scale, window or 0, 0.0,
                                             None, None, torch.full((heads,), 1e4))
    assert high.float().abs().max() < 1e-30


@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_attention_over_a_latent_cache(dtype):
    """Multi-head latent attention's shape (models/mla.py): many query heads over one cached
    "head" of 576 dims (latent 512 + RoPE key 64) that is both the keys and the values (the
    same tensor passed twice)."""
    heads, dim = 16, 576
    q, k_cache, _, tables, lens = decode_case(dtype, heads, 1, dim, 9, [1, 16, 17, 100])
    scale = 1 / math.sqrt(192)
    got = decode(q, k_cache, k_cache, tables, lens, scale)
    want = plain_decode(q, k_cache, k_cache, tables, lens, scale)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
    torch.testing.assert_close(got.float(), want, **tol)


def test_paged_attention_refuses_bad_layouts():
    ops = cpu_kernels.ops()
    cache = torch.zeros(4, 16, 2, 8)
    q = torch.zeros(1, 4, 8)
    tables, lens = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    starts = torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="int32"):
        ops.paged_attention(q, cache, cache, tables.long(), starts, lens, 1.0)
    with pytest.raises(RuntimeError, match="both alike"):
        ops.paged_attention(q, cache, cache.bfloat16(), tables, starts, lens, 1.0)
    with pytest.raises(RuntimeError, match="head shapes"):
        ops.paged_attention(torch.zeros(1, 3, 8), cache, cache, tables, starts, lens, 1.0)
    with pytest.raises(RuntimeError, match="contiguous"):
        ops.paged_attention(q, cache.transpose(1, 2), cache, tables, starts, lens, 1.0)
    with pytest.raises(RuntimeError, match="window"):
        ops.paged_attention(q, cache, cache, tables, starts, lens, 1.0, -1)
    with pytest.raises(RuntimeError, match="softcap"):
        ops.paged_attention(q, cache, cache, tables, starts, lens, 1.0, 0, -2.0)
    with pytest.raises(RuntimeError, match="from 0 to the number of tokens"):
        ops.paged_attention(q, cache, cache, tables, torch.tensor([0, 2], dtype=torch.int32), lens, 1.0)
    with pytest.raises(RuntimeError, match="its length its block table"):
        ops.paged_attention(q, cache, cache, tables, starts, torch.tensor([17], dtype=torch.int32), 1.0)


@pytest.mark.parametrize("window", [0, 37])
def test_paged_attention_key_ends_let_image_tokens_see_their_whole_image(window):
    """Gemma 3's images (key_ends, layers/attention/base.py): A's chunk of positions 200..299 holds
    images at 230..269 and 280..289, whose rows see keys up to their image's end (a window, shorter
    than the first image, still bounds them below), beside B's decode row. The C++ kernel and plain
    torch's plan (what the Triton kernels are tested against) both match the mask written out."""
    q, k_cache, v_cache, tables, lens = invariance_case(torch.float32, torch.float32, 4, 2, 32)
    scale, n = 32 ** -0.5, lens["a"]
    positions = torch.arange(200, n)
    ends = positions + 1
    for start, end in ((230, 270), (280, 290)):
        ends[start - 200:end - 200] = end
    key_ends = torch.cat([torch.tensor([70]), ends]).to(torch.int32)
    queries = torch.cat([q["b"][69:70], q["a"][200:]])
    width = max(len(t) for t in tables.values())
    meta = AttentionMetadata(slot_mapping=torch.zeros(101, dtype=torch.int64),
                             query_start_loc=torch.tensor([0, 1, 101], dtype=torch.int32),
                             seq_lens=torch.tensor([70, n], dtype=torch.int32),
                             block_tables=torch.tensor([t + [0] * (width - len(t)) for t in (tables["b"], tables["a"])],
                                                       dtype=torch.int32),
                             query_lens_cpu=[1, 100], seq_lens_cpu=[70, n], key_ends=key_ends)
    got = cpu_kernels.ops().paged_attention(queries, k_cache, v_cache, meta.block_tables, meta.query_start_loc,
                                            meta.seq_lens, scale, window, 0.0, None, None, None, 0, key_ends)
    with cpu_kernels.disabled():
        planned = TorchReferenceBackend().forward(queries, None, None, k_cache, v_cache, meta, scale, kv_written=True,
                                                  sliding_window=window or None)
    table = torch.tensor([tables["a"]], dtype=torch.int32)
    keys, values = (context_blocks(c, table, n)[:, :n] for c in (k_cache, v_cache))
    mask = torch.arange(n)[None, :] < ends[:, None]
    if window:
        mask &= torch.arange(n)[None, :] > positions[:, None] - window
    want = _matmul_attention(q["a"][200:][None], keys, values, mask[None, None], scale, None)[0]
    assert not torch.equal(mask, torch.arange(n)[None, :] <= positions[:, None])  # some rows see past themselves
    torch.testing.assert_close(got[1:], want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(planned[1:], want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[:1], attend_rows(q, k_cache, v_cache, tables, [("b", 69, 1)], scale, window)[0])
    torch.testing.assert_close(planned[:1], got[:1], rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="key_ends.*within its length"):
        cpu_kernels.ops().paged_attention(queries, k_cache, v_cache, meta.block_tables, meta.query_start_loc,
                                          meta.seq_lens, scale, window, 0.0, None, None, None, 0, key_ends + 1)


def invariance_case(cache_dtype, q_dtype, heads, kv_heads, dim, context=300, block_size=16, seed=0):
    """Two sequences' K/V in shuffled blocks of one cache (A: `context` tokens, B: 70), and
    queries for every position of both."""
    g = torch.Generator().manual_seed(seed)
    lens = {"a": context, "b": 70}
    tables = {}
    perm = torch.randperm(64, generator=g).tolist()
    for name, n in lens.items():
        tables[name] = [perm.pop() for _ in range(-(-n // block_size))]
    values = torch.randn(2, 64, block_size, kv_heads, dim, generator=g)
    if cache_dtype == torch.float8_e4m3fn:
        values = values.clamp(-8, 8)
    k_cache, v_cache = (values[i].to(cache_dtype) for i in range(2))
    q = {name: torch.randn(n, heads, dim, generator=g).to(q_dtype) for name, n in lens.items()}
    return q, k_cache, v_cache, tables, lens


def attend_rows(q, k_cache, v_cache, tables, parts, scale, window=0, softcap=0.0, scales=(None, None)):
    """One paged_attention call over `parts`: (sequence, first query position, rows), each the
    sequence's positions [first, first + rows) as new tokens. Returns each part's output rows."""
    width = max(len(t) for t in tables.values())
    queries = torch.cat([q[name][first:first + n] for name, first, n in parts])
    starts = torch.tensor([0] + [n for _, _, n in parts], dtype=torch.int32).cumsum(0).to(torch.int32)
    lens = torch.tensor([first + n for _, first, n in parts], dtype=torch.int32)
    table = torch.tensor([tables[name] + [0] * (width - len(tables[name])) for name, _, _ in parts], dtype=torch.int32)
    out = cpu_kernels.ops().paged_attention(queries, k_cache, v_cache, table, starts, lens, scale, window, softcap,
                                            *scales)
    return out.split([n for _, _, n in parts])


@pytest.mark.parametrize("cache_dtype,q_dtype", [(torch.float32, torch.float32), (torch.float16, torch.float32),
                                                 (torch.bfloat16, torch.bfloat16), (torch.float8_e4m3fn, torch.float32)])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (8, 1, 40), (4, 4, 128)])
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (37, 0.0), (0, 20.0)])
def test_paged_attention_gives_a_row_the_same_bits_however_its_step_is_cut(cache_dtype, q_dtype, heads, kv_heads,
                                                                          dim, window, softcap):
    """Batch invariance: the rows of A's last 40 positions, computed as decode rows (one a
    call), in prefill chunks of 1, 7, 16, 33 and 40 rows (each chunk over the rest as cached
    context), beside B's decode and B's whole prompt, and in one call of A's whole prompt, are
    the same bits every time. Decode rows and prefill tiles take the two score paths (lanes,
    transposed keys): they must agree bit for bit too. And all of it near plain torch."""
    q, k_cache, v_cache, tables, lens = invariance_case(cache_dtype, q_dtype, heads, kv_heads, dim)
    scale = 1 / math.sqrt(dim)
    scales = (torch.tensor([0.5]), torch.tensor([2.0])) if cache_dtype == torch.float8_e4m3fn else (None, None)
    run = lambda parts: attend_rows(q, k_cache, v_cache, tables, parts, scale, window, softcap, scales)  # noqa: E731
    n = lens["a"]
    (whole,) = run([("a", 0, n)])
    want = whole[n - 40:]
    decoded = torch.cat([run([("a", p, 1)])[0] for p in range(n - 40, n)])
    assert torch.equal(decoded, want)
    for size in (1, 7, 16, 33, 40):
        rows = []
        for first in range(n - 40, n, size):
            rows.append(run([("a", first, min(size, n - first))])[0])
        assert torch.equal(torch.cat(rows), want), size
    beside = run([("b", 69, 1), ("a", n - 40, 40), ("b", 0, 70)])
    assert torch.equal(beside[1], want)
    assert torch.equal(beside[2], run([("b", 0, 70)])[0])
    # near plain torch over the cache's values as read back
    block = k_cache.shape[1]
    table = torch.tensor([tables["a"]], dtype=torch.int32)
    keys, vals = (context_blocks(c, table, n)[0, :n].float() * (1.0 if s is None else float(s))
                  for c, s in ((k_cache, scales[0]), (v_cache, scales[1])))
    positions = torch.arange(n)
    mask = positions[None, :] <= positions[n - 40:, None]
    if window:
        mask &= positions[None, :] > positions[n - 40:, None] - window
    ref = _matmul_attention(q["a"][n - 40:].float()[None], keys[None], vals[None], mask[None, None], scale,
                            softcap or None)[0]
    tol = {"rtol": 1e-5, "atol": 1e-5} if q_dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
    torch.testing.assert_close(want.float(), ref, **tol)
    assert block == 16
