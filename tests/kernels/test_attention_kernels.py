"""The Triton attention kernels against the plain-torch reference backend, at random
shapes and shuffled block tables. Each case runs twice: on the CPU through Triton's
interpreter (small shapes, every run) and on CUDA (`-m gpu`, larger shapes)."""

from __future__ import annotations

import os
import random

import pytest
import torch

triton = pytest.importorskip("triton")

from ember.kernels import cpu as cpu_kernels  # noqa: E402

from ember.kernels.decode_attention import _decode_split_kernel, decode_attention, num_decode_splits  # noqa: E402
from ember.kernels.kv_write import kv_write  # noqa: E402
from ember.kernels.prefill_attention import prefill_attention  # noqa: E402
from ember.layers.attention import AttentionMetadata, get_attention_backend  # noqa: E402
from ember.layers.attention.torch_ref import write_kv  # noqa: E402

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


class Case:
    """Sequences with cached[i] tokens already in a shuffled paged cache and new[i] new ones."""

    def __init__(self, cached, new, heads, kv_heads, head_dim, block_size, device, seed):
        g = torch.Generator().manual_seed(seed)
        dtype = _dtype(device)
        self.cached, self.new = cached, new
        lens = [c + n for c, n in zip(cached, new)]
        num_blocks = sum(-(-n // block_size) for n in lens) + 3
        order = torch.randperm(num_blocks, generator=g).tolist()  # non-contiguous, shuffled blocks
        tables = []
        for n in lens:
            tables.append([order.pop() for _ in range(-(-n // block_size))])
        width = max(len(t) for t in tables) + 1  # a spare column: reads past a table's end are masked
        k_ctx = [torch.randn(n, kv_heads, head_dim, generator=g).to(dtype) for n in lens]
        v_ctx = [torch.randn(n, kv_heads, head_dim, generator=g).to(dtype) for n in lens]
        self.k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)  # junk
        self.v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
        slots = []
        for i, (c, n) in enumerate(zip(cached, new)):
            for p in range(c + n):
                slot = tables[i][p // block_size] * block_size + p % block_size
                if p < c:  # the cached prefix is in place already
                    self.k_cache.view(-1, kv_heads, head_dim)[slot] = k_ctx[i][p]
                    self.v_cache.view(-1, kv_heads, head_dim)[slot] = v_ctx[i][p]
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
        for name in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables"):
            setattr(self.meta, name, getattr(self.meta, name).to(device))
        self.scale = head_dim ** -0.5

    def reference(self) -> torch.Tensor:
        """The torch backend on float32 copies (it writes K/V into its own caches)."""
        kc, vc = self.k_cache.float().clone(), self.v_cache.float().clone()
        meta = AttentionMetadata(**{f: getattr(self.meta, f) for f in
                                    ("slot_mapping", "query_start_loc", "seq_lens", "block_tables",
                                     "query_lens_cpu", "seq_lens_cpu")})
        return get_attention_backend("torch").forward(self.q.float(), self.k.float(), self.v.float(), kc, vc,
                                                      meta, self.scale)


def _random_case(device: str, seed: int, decode: bool) -> Case:
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
    return Case(cached, new, heads, kv_heads, head_dim, block_size, device, seed)


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
def test_prefill_matches_reference(device, seed):
    case = _random_case(device, seed, decode=False)
    want = case.reference()
    kv_write(case.k, case.v, case.k_cache, case.v_cache, case.meta.slot_mapping)
    block = 64 if device == "cuda" else 16
    got = prefill_attention(case.q, case.k_cache, case.v_cache, case.meta.block_tables, case.meta.query_start_loc,
                            case.meta.seq_lens, max(case.new), case.scale, block_m=block, block_n=block)
    torch.testing.assert_close(got.float(), want, **_tol(device))


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
def test_decode_padding_rows_give_zeros(device):
    """A CUDA graph's padded rows (seq_len 0) must not produce NaN."""
    case = _random_case(device, 0, decode=True)
    kv_write(case.k, case.v, case.k_cache, case.v_cache, case.meta.slot_mapping)
    lens = case.meta.seq_lens.clone()
    lens[0] = 0
    got = decode_attention(case.q, case.k_cache, case.v_cache, case.meta.block_tables, lens, case.scale,
                           num_splits=2, block_n=64 if device == "cuda" else 16)
    assert torch.all(got[0] == 0) and not got.isnan().any()


@pytest.mark.parametrize("device", DEVICES)
def test_triton_backend_matches_reference_on_a_mixed_step(device):
    """The backend itself: a step mixing prefills, a prefix-cached extend and decodes."""
    case = Case([0, 37, 5, 60], [20, 9, 1, 1], 4, 2, 32, 8, device, seed=3)
    want = case.reference()
    got = get_attention_backend("triton").forward(case.q, case.k, case.v, case.k_cache, case.v_cache, case.meta,
                                                  case.scale)
    torch.testing.assert_close(got.float(), want, **_tol(device))


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
