"""The fused small-op kernels (RMSNorm with residual, SiLU-and-mul, RoPE) against the
plain-torch layer code they replace on CUDA. CPU: Triton's interpreter; `-m gpu`: CUDA."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from ember.kernels import cpu as cpu_kernels  # noqa: E402
from ember.kernels.activation import gelu_tanh_and_mul as fused_gelu_tanh_and_mul  # noqa: E402
from ember.kernels.activation import silu_and_mul as fused_silu_and_mul  # noqa: E402
from ember.kernels.kv_write import kv_write  # noqa: E402
from ember.kernels.rms_norm import rms_norm  # noqa: E402
from ember.kernels.rotary import qk_norm_rope_inplace, rope_inplace  # noqa: E402
from ember.layers.activation import gelu_tanh_and_mul, silu_and_mul  # noqa: E402
from ember.layers.norm import RMSNorm  # noqa: E402
from ember.layers.rotary import RotaryEmbedding, apply_rotary  # noqa: E402


@pytest.fixture(autouse=True)
def plain_torch_reference():
    """The reference is the plain-torch layer code, not the C++ CPU kernels."""
    with cpu_kernels.disabled():
        yield


DEVICES = [pytest.param("cpu", id="interpreter"), pytest.param("cuda", marks=pytest.mark.gpu, id="cuda")]


def _setup(device):
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    tol = dict(atol=2e-2, rtol=2e-2) if device == "cuda" else dict(atol=1e-5, rtol=1e-5)
    return torch.Generator().manual_seed(0), dtype, tol


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("size", [64, 96])
def test_rms_norm_with_and_without_residual(device, size):
    g, dtype, tol = _setup(device)
    norm = RMSNorm(size, 1e-6)
    norm.weight.data = (1 + 0.1 * torch.randn(size, generator=g)).to(dtype)
    x = torch.randn(7, size, generator=g).to(dtype)
    res = torch.randn(7, size, generator=g).to(dtype)
    want_y, want_res = norm(x, res.clone())  # the CPU (torch) path
    w = norm.weight.detach().to(device)
    torch.testing.assert_close(rms_norm(x.to(device), w, 1e-6).cpu(), norm(x), **tol)
    got_res = res.to(device)
    got_y = rms_norm(x.to(device), w, 1e-6, got_res)
    torch.testing.assert_close(got_y.cpu(), want_y, **tol)
    torch.testing.assert_close(got_res.cpu(), want_res, **tol)


@pytest.mark.parametrize("device", DEVICES)
def test_rms_norm_per_head_on_a_strided_view(device):
    """Qwen3's q/k norm: x is [T, heads, D] cut out of the fused qkv output."""
    g, dtype, tol = _setup(device)
    qkv = torch.randn(5, 4 * 32 + 2 * 2 * 32, generator=g).to(dtype)
    q = qkv[:, :128].view(5, 4, 32)
    norm = RMSNorm(32, 1e-6)
    norm.weight.data = (1 + 0.1 * torch.randn(32, generator=g)).to(dtype)
    got = rms_norm(qkv.to(device)[:, :128].view(5, 4, 32), norm.weight.detach().to(device), 1e-6)
    torch.testing.assert_close(got.cpu(), norm(q), **tol)


@pytest.mark.parametrize("device", DEVICES)
def test_silu_and_mul(device):
    g, dtype, tol = _setup(device)
    x = torch.randn(6, 2 * 80, generator=g).to(dtype)
    torch.testing.assert_close(fused_silu_and_mul(x.to(device), block=32).cpu(), silu_and_mul(x), **tol)


@pytest.mark.parametrize("device", DEVICES)
def test_gelu_tanh_and_mul(device):
    g, dtype, tol = _setup(device)
    x = 3 * torch.randn(6, 2 * 80, generator=g).to(dtype)  # into gelu's curved range and its tails
    torch.testing.assert_close(fused_gelu_tanh_and_mul(x.to(device), block=32).cpu(), gelu_tanh_and_mul(x), **tol)


# (head_dim, rotary_dim): RoPE on whole heads, and partial RoPE (Phi-4-mini's 3/4 of each head):
# 24 of 32 dims turn, halves of 12 (not a power of two), 8 dims pass through; head dims that are
# not a power of two: Phi-2's 80 (32 turn, 48 pass) and Phi-3-mini's 96 (all turn)
ROTARY = [pytest.param((32, 32), id="whole_head"), pytest.param((32, 24), id="partial"),
          pytest.param((80, 32), id="phi2-80"), pytest.param((96, 96), id="phi3-96")]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dims", ROTARY)
def test_rope_in_place_on_qkv_views(device, dims):
    g, dtype, tol = _setup(device)
    (dim, rotary_dim), heads, kv_heads, tokens = dims, 4, 2, 6
    rotary = RotaryEmbedding(rotary_dim, 64, 10000.0, None)
    positions = torch.tensor([0, 5, 1, 63, 17, 2])
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g).to(dtype)

    def views(t):
        return t[:, :heads * dim].view(tokens, heads, dim), t[:, heads * dim:(heads + kv_heads) * dim].view(
            tokens, kv_heads, dim)

    want_q, want_k, _ = apply_rotary(*views(qkv), rotary.lookup(positions))
    got = qkv.to(device)
    rope_inplace(*views(got), rotary.lookup(positions).to(device))
    got_q, got_k = views(got.cpu())
    torch.testing.assert_close(got_q, want_q, **tol)
    torch.testing.assert_close(got_k, want_k, **tol)
    assert torch.equal(got[:, (heads + kv_heads) * dim:].cpu(), qkv[:, (heads + kv_heads) * dim:])  # v untouched
    if rotary_dim < dim:  # the dims past the rotary ones pass through, bit for bit
        q, k = views(qkv)
        assert torch.equal(got_q[..., rotary_dim:], q[..., rotary_dim:])
        assert torch.equal(got_k[..., rotary_dim:], k[..., rotary_dim:])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dims", ROTARY)
def test_qk_norm_and_rope_in_one_kernel_on_qkv_views(device, dims):
    """Qwen3: per-head RMSNorm of q and k, then RoPE, in place, as the three layer ops do
    (with partial RoPE the norm still spans the whole head)."""
    g, dtype, tol = _setup(device)
    (dim, rotary_dim), heads, kv_heads, tokens = dims, 6, 2, 5
    rotary = RotaryEmbedding(rotary_dim, 64, 10000.0, None)
    positions = torch.tensor([0, 9, 1, 63, 30])
    q_norm, k_norm = RMSNorm(dim, 1e-6), RMSNorm(dim, 1e-6)
    q_norm.weight.data = (1 + 0.3 * torch.randn(dim, generator=g)).to(dtype)
    k_norm.weight.data = (1 + 0.3 * torch.randn(dim, generator=g)).to(dtype)
    qkv = (3 * torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g)).to(dtype)

    def views(t):
        return t[:, :heads * dim].view(tokens, heads, dim), t[:, heads * dim:(heads + kv_heads) * dim].view(
            tokens, kv_heads, dim)

    q, k = views(qkv)
    want_q, want_k, _ = apply_rotary(q_norm(q), k_norm(k), rotary.lookup(positions))
    got = qkv.to(device)
    qk_norm_rope_inplace(*views(got), q_norm.weight.detach().to(device), k_norm.weight.detach().to(device), 1e-6,
                         rotary.lookup(positions).to(device))
    got_q, got_k = views(got.cpu())
    torch.testing.assert_close(got_q, want_q, **tol)
    torch.testing.assert_close(got_k, want_k, **tol)
    assert torch.equal(got[:, (heads + kv_heads) * dim:].cpu(), qkv[:, (heads + kv_heads) * dim:])  # v untouched
    with pytest.raises(ValueError, match="norm weights"):
        qk_norm_rope_inplace(*views(got), q_norm.weight.detach()[:8].to(device), k_norm.weight.detach().to(device),
                             1e-6, rotary.lookup(positions).to(device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("norm", [False, True], ids=["rope", "qk_norm_rope"])
@pytest.mark.parametrize("fp8", [False, True], ids=["cache_in_dtype", "fp8_cache"])
@pytest.mark.parametrize("dims", ROTARY)
def test_rope_kernel_writes_the_cache_as_kv_write_does(device, norm, fp8, dims):
    """Given the paged cache, the RoPE kernel also stores the rotated k and v at each
    token's slot: the same bits as rotating and then running the KV-write kernel, a padded
    row (slot -1) writing nothing, an fp8 cache quantized with its scales; with partial RoPE
    the dims that pass through too."""
    g, dtype, _ = _setup(device)
    (dim, rotary_dim), heads, kv_heads, tokens, page = dims, 4, 2, 5, 4
    rotary = RotaryEmbedding(rotary_dim, 64, 10000.0, None)
    cos_sin = rotary.lookup(torch.tensor([0, 7, 3, 40, 12])).to(device)
    qkv = (2 * torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g)).to(dtype).to(device)
    weights = [(1 + 0.3 * torch.randn(dim, generator=g)).to(dtype).to(device) for _ in range(2)]
    cache_dtype = torch.float8_e4m3fn if fp8 else dtype
    junk = torch.randn(2, 4, page, kv_heads, dim, generator=g).to(cache_dtype).to(device)
    slots = torch.tensor([9, 2, -1, 14, 5], device=device)
    scales = [torch.tensor([x], device=device) for x in (0.5, 2.0)] if fp8 else [None, None]

    def views(t):
        q = t[:, :heads * dim].view(tokens, heads, dim)
        k = t[:, heads * dim:(heads + kv_heads) * dim].view(tokens, kv_heads, dim)
        return q, k, t[:, (heads + kv_heads) * dim:].view(tokens, kv_heads, dim)

    def rotate(t, **cache):
        q, k, v = views(t)
        if norm:
            qk_norm_rope_inplace(q, k, *weights, 1e-6, cos_sin, **({"v": v} | cache if cache else {}))
        else:
            rope_inplace(q, k, cos_sin, **({"v": v} | cache if cache else {}))

    want, want_cache = qkv.clone(), junk.clone()
    rotate(want)
    kv_write(*views(want)[1:], *want_cache, slots, *scales)
    got, got_cache = qkv.clone(), junk.clone()
    rotate(got, k_cache=got_cache[0], v_cache=got_cache[1], slot_mapping=slots, k_scale=scales[0],
           v_scale=scales[1])
    assert torch.equal(got, want)
    assert torch.equal(got_cache.view(torch.uint8), want_cache.view(torch.uint8))
    assert not torch.equal(got_cache.view(torch.uint8), junk.view(torch.uint8))
