"""The paged reference attention equals dense causal attention, whatever the block layout;
with an fp8 cache, dense attention over the same K/V quantized and read back."""

import math

import pytest
import torch

from ember.kernels import cpu as cpu_kernels
from ember.layers.attention import AttentionMetadata, get_attention_backend
from ember.layers.attention.torch_ref import FP8, dequantize_kv, quantize_kv


@pytest.fixture(autouse=True, params=["cpu-kernels", "plain-torch"])
def kernels(request):
    """Every case runs twice: every row through the C++ kernel, and in plain torch."""
    if request.param == "cpu-kernels":
        assert cpu_kernels.ops() is not None
        yield
    else:
        with cpu_kernels.disabled():
            yield


def dense_attention(q, k, v, scale, window=None, softcap=None, chunk=None):
    """q: [n, H, D] for the last n positions of a context k/v: [L, Hkv, D]; causal, and with
    `window` each query sees its last `window` positions only, with `chunk` C only those of its
    own chunk (p // C * C on); `softcap` c: c * tanh(s / c)."""
    n, L, group = q.shape[0], k.shape[0], q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("nhd,lhd->hnl", q, k) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    q_pos = torch.arange(L - n, L)[:, None]
    hidden = torch.arange(L)[None, :] > q_pos
    if window is not None:
        hidden |= torch.arange(L)[None, :] <= q_pos - window
    if chunk is not None:
        hidden |= torch.arange(L)[None, :] < q_pos // chunk * chunk
    scores = scores.masked_fill(hidden, float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v)


def run_case(cached: list[int], new: list[int], heads=6, kv_heads=2, head_dim=16, block_size=4, seed=0,
             dtype=torch.float32, fp8_scales=None, window=None, softcap=None, chunk=None, decode_rows=False):
    """Sequences with `cached[i]` tokens already in the cache and `new[i]` new ones; with
    fp8_scales (k, v) the cache is float8_e4m3fn; with decode_rows, every new token attends as a
    sequence of its own (AttentionMetadata.as_decode_rows)."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-(c + n) // block_size) for c, n in zip(cached, new)) + 3
    cache_dtype = dtype if fp8_scales is None else FP8
    k_scale, v_scale = (None, None) if fp8_scales is None else (torch.tensor([s]) for s in fp8_scales)
    k_cache = torch.zeros(num_blocks, block_size, kv_heads, head_dim, dtype=cache_dtype)
    v_cache = torch.zeros_like(k_cache)
    free = torch.randperm(num_blocks, generator=g).tolist()  # shuffled, non-contiguous blocks
    full_k, full_v, tables = [], [], []
    for c, n in zip(cached, new):
        blocks = [free.pop() for _ in range(-(-(c + n) // block_size))]
        tables.append(blocks)
        kk = torch.randn(c + n, kv_heads, head_dim, generator=g).to(dtype)
        vv = torch.randn(c + n, kv_heads, head_dim, generator=g).to(dtype)
        for p in range(c):  # the cached prefix is already in place
            k_cache[blocks[p // block_size], p % block_size] = quantize_kv(kk[p], cache_dtype, k_scale)
            v_cache[blocks[p // block_size], p % block_size] = quantize_kv(vv[p], cache_dtype, v_scale)
        full_k.append(kk)
        full_v.append(vv)
    q = torch.randn(sum(new), heads, head_dim, generator=g).to(dtype)
    k = torch.cat([kk[c:] for kk, c in zip(full_k, cached)])
    v = torch.cat([vv[c:] for vv, c in zip(full_v, cached)])
    slots = [tables[i][p // block_size] * block_size + p % block_size
             for i, (c, n) in enumerate(zip(cached, new)) for p in range(c, c + n)]
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        query_start_loc=torch.tensor([0] + list(torch.tensor(new).cumsum(0)), dtype=torch.int32),
        seq_lens=torch.tensor([c + n for c, n in zip(cached, new)], dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        query_lens_cpu=list(new),
        seq_lens_cpu=[c + n for c, n in zip(cached, new)],
    )
    scale = 1 / math.sqrt(head_dim)
    run_meta = meta.as_decode_rows() if decode_rows else meta
    out = get_attention_backend("torch").forward(q, k, v, k_cache, v_cache, run_meta, scale, k_scale, v_scale,
                                                 sliding_window=window, logit_softcap=softcap,
                                                 attention_chunk=chunk)
    start = 0
    for i, (c, n) in enumerate(zip(cached, new)):
        # what the cache holds, read back: the K/V themselves, or their fp8 round trip
        kk, vv = (dequantize_kv(quantize_kv(x, cache_dtype, s), s).float()
                  for x, s in ((full_k[i], k_scale), (full_v[i], v_scale)))
        expected = dense_attention(q[start:start + n].float(), kk, vv, scale, window, softcap, chunk)
        tol = 1e-5 if dtype == torch.float32 else 1e-2  # bfloat16 output: 8 bits of mantissa
        torch.testing.assert_close(out[start:start + n].float(), expected, rtol=tol, atol=tol)
        start += n
    # the new K/V landed in the cache, in their slots
    flat_k = k_cache.view(-1, kv_heads, head_dim)
    want = quantize_kv(k, cache_dtype, k_scale)
    assert torch.equal(flat_k[torch.tensor(slots)].view(torch.uint8), want.view(torch.uint8))
    return meta


def test_prefill_only():
    run_case(cached=[0, 0, 0], new=[5, 1, 9])


def test_decode_batch():
    run_case(cached=[7, 0, 12, 3], new=[1, 1, 1, 1])


def test_mixed_prefix_extend_and_decode():
    # a chunked prefill over a cached prefix, decodes, and a fresh prompt in one step
    run_case(cached=[9, 4, 0, 17], new=[6, 1, 3, 1], seed=3)


def test_bfloat16_cache_decode_and_extend():
    run_case(cached=[9, 4, 0, 17, 30], new=[6, 1, 3, 1, 1], seed=5, dtype=torch.bfloat16)


def test_fp8_cache_decode_and_extend():
    run_case(cached=[9, 4, 0, 17, 30], new=[6, 1, 3, 1, 1], seed=5, fp8_scales=(1.0, 1.0))


def test_fp8_cache_with_scales_in_bfloat16():
    # bfloat16 queries take the reference's float32 decode path; short chunks and a long prompt too
    run_case(cached=[9, 4, 0, 17, 3, 30], new=[6, 1, 3, 2, 1, 20], seed=7, dtype=torch.bfloat16,
             fp8_scales=(0.25, 4.0))


def test_fp8_quantization_saturates_and_rounds_to_nearest_even():
    x = torch.tensor([1000.0, -1000.0, 448.0, 17.0, 19.0, 0.3])
    got = quantize_kv(x, FP8, torch.tensor([1.0])).float().tolist()
    assert got == [448.0, -448.0, 448.0, 16.0, 20.0, 0.3125]  # 17: tie -> even mantissa; 19: tie -> 20
    # scaled: 1000 / 4 = 250 is in range, and rounds to 256 (steps of 16 there)
    assert quantize_kv(x, FP8, torch.tensor([4.0])).float().tolist()[:2] == [256.0, -256.0]


def test_short_chunks_share_one_padded_batch_and_long_ones_run_alone(kernels):
    # plain torch's plan: jump-forward's appended tokens (2..16 new tokens over a cached
    # prefix) next to decodes and a prompt longer than SHORT_CHUNK
    if cpu_kernels.for_tensor(torch.zeros(1)) is not None:
        pytest.skip("the C++ kernel takes every row as it comes: no plan")
    meta = run_case(cached=[9, 4, 0, 17, 3, 30], new=[6, 1, 3, 2, 1, 20], seed=7)
    decode, short, long = meta.plans[("torch", (None, None))]
    assert decode.tables.shape[0] == 2 and long.tables.shape[0] == 1 and long.mask.shape[2] == 20
    assert short.mask.shape[:3] == (3, 1, 6)  # three sequences, padded to the widest (6)
    # rows: seq 0's 6 new tokens, seq 2's 3 (its last repeated), seq 3's 2 (its last repeated)
    assert short.tokens.tolist() == [0, 1, 2, 3, 4, 5, 7, 8, 9, 9, 9, 9, 10, 11, 11, 11, 11, 11]


@pytest.mark.parametrize("window", [1, 3, 8])
def test_sliding_window_in_decode_short_chunks_and_prefill(window):
    # contexts longer and shorter than the window, in each kind of group
    run_case(cached=[9, 4, 0, 17, 3, 30, 0], new=[6, 1, 3, 2, 1, 20, 1], seed=11, window=window)


def test_sliding_window_and_softcap_in_bfloat16_and_fp8():
    run_case(cached=[9, 4, 0, 30], new=[6, 1, 20, 1], seed=12, window=5, softcap=2.0, dtype=torch.bfloat16)
    run_case(cached=[9, 4, 0, 30], new=[6, 1, 20, 1], seed=12, window=5, fp8_scales=(0.5, 2.0))


@pytest.mark.parametrize("chunk", [1, 4, 8])
def test_attention_chunks_in_decode_short_chunks_and_prefill(chunk):
    # Llama 4's chunked local attention: queries at, just past and far past chunk starts, in
    # each kind of group, a prefill that crosses several chunks, bfloat16 and fp8 too
    run_case(cached=[9, 4, 0, 17, 3, 30, 0, 7], new=[6, 1, 3, 2, 1, 20, 1, 1], seed=14, chunk=chunk)
    run_case(cached=[9, 4, 0, 31], new=[6, 1, 20, 1], seed=15, chunk=chunk, softcap=2.0, dtype=torch.bfloat16)
    run_case(cached=[9, 4, 0, 31], new=[6, 1, 20, 1], seed=15, chunk=chunk, fp8_scales=(0.5, 2.0))


@pytest.mark.parametrize("options", [{}, {"window": 3}, {"chunk": 4}, {"fp8_scales": (0.5, 2.0)}],
                         ids=["causal", "window", "chunk", "fp8"])
def test_each_new_token_as_a_decode_row_of_its_own(options):
    """A step verifying drafts runs as decode rows (the decode CUDA graphs): a row a token, its
    sequence ending at it, over its sequence's blocks; the same attention as the chunks'."""
    meta = run_case([5, 0, 9, 2], [4, 6, 1, 3], decode_rows=True, **options)
    rows = meta.as_decode_rows()
    assert rows.seq_lens_cpu == [6, 7, 8, 9, 1, 2, 3, 4, 5, 6, 10, 3, 4, 5] == rows.seq_lens.tolist()
    assert rows.query_lens_cpu == [1] * 14 and rows.query_start_loc.tolist() == list(range(15))
    assert torch.equal(rows.block_tables, meta.block_tables[[0] * 4 + [1] * 6 + [2] + [3] * 3])


def test_logit_softcap():
    # scores big enough for the cap to bite: scale 1 instead of 1/sqrt(D) would be the same test
    run_case(cached=[9, 4, 0, 17], new=[6, 1, 20, 1], seed=13, softcap=0.5)


def test_mha_without_gqa():
    run_case(cached=[2, 5], new=[3, 1], heads=4, kv_heads=4)


def test_refuses_unknown_backend():
    import pytest

    with pytest.raises(ValueError, match="unknown attention backend 'nope'"):
        get_attention_backend("nope")
