"""The fused MoE kernels (kernels/moe.py) against plain torch: routing exactly (ids) and to
float rounding (weights), the expert grouping exactly (every pair once, in its expert's
padded group), and the whole expert MLP against a float32 per-token loop; gpt-oss's biases and
clamped SwiGLU against the torch path, its MXFP4 experts against their decoded weights, FP8
experts (DeepSeek-V3's 128 x 128 block scales, or per row) against the dense kernels and the
torch path on their dequantized weights, integer experts (AWQ / GPTQ / compressed-tensors W4A16
and W8A16: 4 or 8 bits, groups of 32 to a whole row, with or without zero points) against the
per-token loop on their dequantized weights. CPU: Triton's interpreter at small shapes; `-m gpu`:
CUDA at real shapes, and the layer in a CUDA graph."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from graph_replay import assert_graph_replays  # noqa: E402
from hopper_compile import run_compile_script  # noqa: E402

from ember.kernels.moe import (  # noqa: E402
    FP8Experts,
    IntExperts,
    MXFP4Experts,
    align_experts,
    fused_experts,
    heuristic_config,
    max_padded_rows,
    moe_configs,
    route_topk,  # noqa: E402
)
from ember.layers.kernel_paths import gemv_on_cpu  # noqa: E402
from ember.layers.moe import FusedMoE, grouped_experts  # noqa: E402
from ember.layers.quant.fp8 import FP8, FP8Tensor, dequantize_experts  # noqa: E402
from ember.layers.quant.int_weight import IntTensor, pack_words, quantize_int  # noqa: E402
from ember.layers.quant.mxfp4 import dequantize_mxfp4  # noqa: E402

DEVICES = [pytest.param("cpu", id="interpreter"), pytest.param("cuda", marks=pytest.mark.gpu, id="cuda")]


def _loop_reference(x, w13, w2, weights, ids):
    """The definition, token by token, in float32."""
    x, w13, w2 = x.float(), w13.float(), w2.float()
    out = torch.zeros_like(x)
    inter = w13.shape[1] // 2
    for t in range(x.shape[0]):
        for slot in range(ids.shape[1]):
            e = int(ids[t, slot])
            h = x[t] @ w13[e].t()
            out[t] += float(weights[t, slot]) * ((F.silu(h[:inter]) * h[inter:]) @ w2[e].t())
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("experts,top_k,renormalize", [(8, 2, True), (60, 4, False), (128, 8, True)])
def test_routing_is_softmax_topk(device, experts, top_k, renormalize):
    g = torch.Generator().manual_seed(experts)
    logits = torch.randn(5, experts, generator=g).to(device)
    weights, ids = route_topk(logits, top_k, renormalize)
    probs = torch.softmax(logits.float(), dim=-1)
    want_w, want_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        want_w = want_w / want_w.sum(dim=-1, keepdim=True)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert torch.equal(ids.long().cpu(), want_ids.cpu())
    torch.testing.assert_close(weights.cpu(), want_w.cpu(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tokens,experts,top_k,block_m", [(1, 8, 2, 16), (7, 8, 2, 16), (40, 128, 8, 16),
                                                           (300, 8, 2, 64), (0, 8, 2, 16)])
def test_alignment_groups_every_pair_once_by_expert(device, tokens, experts, top_k, block_m):
    g = torch.Generator().manual_seed(tokens)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)]) if tokens else \
        torch.empty(0, top_k, dtype=torch.int64)
    if tokens >= 300:
        ids[:200, 0] = 3  # one expert much busier than the rest
        ids[:200, 1] = torch.where(ids[:200, 1] == 3, 4, ids[:200, 1])
    ids = ids.to(torch.int32).to(device)
    sorted_pairs, block_expert, num_padded = align_experts(ids, experts, block_m)
    pairs = tokens * top_k
    rows = max_padded_rows(pairs, experts, block_m)
    assert sorted_pairs.shape == (rows,) and block_expert.shape == (-(-rows // block_m),)
    flat = ids.reshape(-1).long().cpu()
    counts = torch.bincount(flat, minlength=experts)
    padded = (counts + block_m - 1) // block_m * block_m
    assert int(num_padded) == int(padded.sum())
    used = sorted_pairs[:int(num_padded)].long().cpu()
    blocks = block_expert[:int(num_padded) // block_m].long().cpu()
    # the padded groups in expert order, each holding exactly its expert's pairs, in pair order
    want_blocks = torch.repeat_interleave(torch.arange(experts), padded // block_m)
    assert torch.equal(blocks, want_blocks)
    start = 0
    for e in range(experts):
        group = used[start:start + int(padded[e])]
        assert torch.equal(group[:int(counts[e])], torch.nonzero(flat == e).flatten())
        assert torch.all(group[int(counts[e]):] == pairs)
        start += int(padded[e])


def _experts(experts, hidden, inter, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g) / hidden ** 0.5).to(dtype).to(device)
    w2 = (torch.randn(experts, hidden, inter, generator=g) / inter ** 0.5).to(dtype).to(device)
    return w13, w2


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,experts,top_k,hidden,inter", [(1, 8, 2, 64, 96), (9, 16, 4, 48, 40),
                                                               (70, 8, 2, 32, 64)])
def test_fused_experts_match_the_per_token_loop(device, dtype, tokens, experts, top_k, hidden, inter):
    g = torch.Generator().manual_seed(tokens)
    w13, w2 = _experts(experts, hidden, inter, dtype, device)
    x = torch.randn(tokens, hidden, generator=g).to(dtype).to(device)
    weights, ids = route_topk(torch.randn(tokens, experts, generator=g).to(device), top_k, True)
    got = fused_experts(x, w13, w2, weights, ids)
    want = _loop_reference(x.cpu(), w13.cpu(), w2.cpu(), weights.cpu(), ids.cpu())
    assert got.dtype == dtype and got.shape == (tokens, hidden)
    tol = {torch.float32: 1e-4, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(got.float().cpu(), want, rtol=tol, atol=tol)


def test_each_tile_config_gives_the_same_result():
    """Every moe_config bucket (16..128-row blocks, gated or not) on one input."""
    w13, w2 = _experts(4, 32, 32, torch.float32, "cpu", seed=3)
    x = torch.randn(20, 32, generator=torch.Generator().manual_seed(3))
    weights, ids = route_topk(torch.randn(20, 4, generator=torch.Generator().manual_seed(4)), 2, True)
    want = _loop_reference(x, w13, w2, weights, ids)
    import ember.kernels.moe as moe

    configs = {tuple(heuristic_config(4, t, 2).items()) for t in (1, 64, 256, 4096)}
    assert len(configs) == 4
    for cfg in configs:
        small = dict(cfg, BLOCK_K=min(dict(cfg)["BLOCK_K"], 32), BLOCK_N=min(dict(cfg)["BLOCK_N"], 32))
        sorted_pairs, block_expert, num_padded = align_experts(ids, 4, small["BLOCK_M"])
        act = torch.empty(40, 32)
        moe.moe_gemm(x, w13, act, sorted_pairs, block_expert, num_padded, None, 2, True, small)
        out = torch.empty(40, 32)
        moe.moe_gemm(act, w2, out, sorted_pairs, block_expert, num_padded, weights.reshape(-1), 1, False, small)
        torch.testing.assert_close(out.view(20, 2, 32).sum(1), want, rtol=1e-4, atol=1e-4)


def test_tuned_configs_are_read_for_their_gpu_and_the_nearest_token_count():
    """moe_configs.json holds what moe_tune.py measured on the H200; other GPUs (and the
    interpreter) get the heuristic."""
    up, down = moe_configs(128, 2048, 768, 8, 1, "NVIDIA H200")
    assert up["BLOCK_M"] == down["BLOCK_M"] == 16 and (up["BLOCK_N"], down["BLOCK_N"]) == (64, 32)
    assert moe_configs(128, 2048, 768, 8, 1024, "NVIDIA H200") == moe_configs(128, 2048, 768, 8, 512, "NVIDIA H200")
    assert moe_configs(8, 4096, 14336, 2, 512, "NVIDIA H200")[0]["BLOCK_M"] == 128
    heuristic = heuristic_config(128, 1, 8)
    assert moe_configs(128, 2048, 768, 8, 1, "") == (heuristic, heuristic)
    assert moe_configs(128, 2048, 768, 8, 1, "NVIDIA A100") == (heuristic, heuristic)
    assert moe_configs(64, 2048, 768, 8, 1, "NVIDIA H200") == (heuristic_config(64, 1, 8),) * 2


@torch.inference_mode()
def test_the_layer_takes_the_fused_path_and_agrees_with_the_cpu_path():
    torch.manual_seed(5)
    layer = FusedMoE(48, 40, 16, 4, renormalize=False)
    for p in layer.parameters():
        p.data.normal_(0, 0.2)
    x = torch.randn(11, 48)
    want = layer(x)  # the torch path (grouped_experts)
    with gemv_on_cpu():
        got = layer(x)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    weights, ids = layer.route(layer.gate(x))
    torch.testing.assert_close(grouped_experts(x, layer.w13, layer.w2, weights, ids),
                               _loop_reference(x, layer.w13, layer.w2, weights, ids), rtol=1e-4, atol=1e-5)


SWIGLU = (1.702, 7.0)  # gpt-oss's alpha and limit


def _gpt_oss_experts(experts, hidden, inter, dtype, device, seed=0):
    """Weights and biases whose gate|up pre-activations (std ~6 on unit inputs) pass the clamp
    at 7 in many rows, and a down bias as large as the expert's output."""
    g = torch.Generator().manual_seed(seed)
    w13 = (6 * torch.randn(experts, 2 * inter, hidden, generator=g) / hidden ** 0.5).to(dtype).to(device)
    w2 = (torch.randn(experts, hidden, inter, generator=g) / inter ** 0.5).to(dtype).to(device)
    b13 = (2 * torch.randn(experts, 2 * inter, generator=g)).to(dtype).to(device)
    b2 = (3 * torch.randn(experts, hidden, generator=g)).to(dtype).to(device)
    return w13, w2, (b13, b2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 6, 33])
def test_biased_clamped_experts_match_the_torch_path(device, dtype, tokens):
    """gpt-oss's experts (biases, the clamped SwiGLU, the weight applied after the down bias)
    in the fused kernels against the torch path's grouped_experts in float32 on the same
    routing: float32 to 1e-6 of the output's scale (the kernel's dot sums in another order
    than torch's matmul; measured 1.5e-7), bfloat16 to 2e-2 of it (the kernel rounds the
    activation and each slot's output to bf16; measured 1.1e-2)."""
    g = torch.Generator().manual_seed(tokens)
    w13, w2, biases = _gpt_oss_experts(4, 64, 64, dtype, device)
    x = torch.randn(tokens, 64, generator=g).to(dtype).to(device)
    weights, ids = route_topk(torch.randn(tokens, 4, generator=g).to(device), 2, True)
    got = fused_experts(x, w13, w2, weights, ids, biases, SWIGLU)
    want = grouped_experts(x.float(), w13.float(), w2.float(), weights, ids.long(), tuple(b.float() for b in biases),
                           SWIGLU)
    gate_up = torch.stack([x.float() @ w13[e].float().t() + biases[0][e].float() for e in range(4)])
    assert (gate_up[..., :64] > 7).any() and (gate_up[..., 64:].abs() > 7).any()  # both clamps bite
    assert got.dtype == dtype and got.shape == (tokens, 64)
    scale = want.abs().max().item()
    tol = {torch.float32: 1e-6, torch.bfloat16: 2e-2}[dtype] * scale
    torch.testing.assert_close(got.float().cpu(), want.cpu(), rtol=0, atol=tol)


@torch.inference_mode()
def test_the_gpt_oss_layer_takes_the_fused_path_and_agrees_with_the_cpu_path():
    """FusedMoE with gpt-oss's router bias, expert biases and clamped SwiGLU: route_topk's
    softmax-top-k-renormalized picks the experts the torch route does with the same weights as
    transformers' softmax over the top-k logits, and the layer's fused output equals its torch path."""
    torch.manual_seed(6)
    layer = FusedMoE(64, 64, 4, 2, renormalize=True, biased=True, swiglu=SWIGLU)
    w13, w2, (b13, b2) = _gpt_oss_experts(4, 64, 64, torch.float32, "cpu", seed=6)
    for param, value in ((layer.w13, w13), (layer.w2, w2), (layer.w13_bias, b13), (layer.w2_bias, b2)):
        param.data.copy_(value)
    layer.gate.weight.data.normal_(0, 0.3)
    layer.gate.bias.data.normal_(0, 0.5)
    x = torch.randn(9, 64)
    logits = layer.gate(x)
    top, top_ids = torch.topk(logits, 2, dim=-1)  # transformers' GptOssTopKRouter
    weights, ids = route_topk(logits, 2, True)
    assert torch.equal(ids.long(), top_ids)
    torch.testing.assert_close(weights, torch.softmax(top, dim=-1), rtol=1e-6, atol=1e-7)
    want = layer(x)  # the torch path (grouped_experts)
    with gemv_on_cpu():
        got = layer(x)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6 * want.abs().max().item())


def _mxfp4(experts, rows, cols, device, seed, exponents=(119, 125)):
    """Random MXFP4 weights [E, rows, cols] (every e2m1 code, both nibbles) as the kernels take
    them, and their reference decoding (float32, on the device, a few experts at a time)."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (experts, rows, cols // 32, 16), generator=g, dtype=torch.uint8).to(device)
    scales = torch.randint(*exponents, (experts, rows, cols // 32), generator=g, dtype=torch.uint8).to(device)
    decoded = torch.cat([dequantize_mxfp4(blocks[e:e + 8], scales[e:e + 8]) for e in range(0, experts, 8)])
    return MXFP4Experts(blocks.flatten(-2), scales), decoded


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,hidden,inter", [(1, 64, 64), (6, 64, 64), (33, 96, 64)])
def test_mxfp4_experts_match_their_decoded_weights(device, dtype, tokens, hidden, inter):
    """The MXFP4 kernels (values decoded in registers) against the same kernels on the weights
    dequantize_mxfp4 decodes, gpt-oss's biases and clamp on: bfloat16 bit for bit (a decoded
    value is exact in bfloat16, so both dots see the same operands), float32 to 1e-6 of the
    output's scale (the interpreter's dot sums a transposed tile in another order); and both
    against the torch path on the decoded weights. Hidden 96: a k-tile of 64 half past K."""
    g = torch.Generator().manual_seed(tokens)
    m13, w13 = _mxfp4(4, 2 * inter, hidden, device, seed=1)
    m2, w2 = _mxfp4(4, hidden, inter, device, seed=2)
    _, _, biases = _gpt_oss_experts(4, hidden, inter, dtype, device)
    x = torch.randn(tokens, hidden, generator=g).to(dtype).to(device)
    weights, ids = route_topk(torch.randn(tokens, 4, generator=g).to(device), 2, True)
    got = fused_experts(x, m13, m2, weights, ids, biases, SWIGLU)
    dense = fused_experts(x, w13.to(dtype), w2.to(dtype), weights, ids, biases, SWIGLU)
    want = grouped_experts(x.float(), w13, w2, weights, ids.long(), tuple(b.float() for b in biases), SWIGLU)
    assert got.dtype == dtype and got.shape == (tokens, hidden)
    scale = want.abs().max().item()
    if dtype == torch.bfloat16 and device == "cpu":
        assert torch.equal(got, dense)
    else:
        torch.testing.assert_close(got, dense, rtol=0, atol={torch.float32: 1e-6, torch.bfloat16: 1e-2}[dtype] * scale)
    torch.testing.assert_close(got.float(), want, rtol=0, atol={torch.float32: 1e-6, torch.bfloat16: 2e-2}[dtype] * scale)


def test_mxfp4_nibble_order_and_scales_by_hand():
    """One expert, one row of 64 inputs: byte j holds k = 2j in its low nibble, 2j + 1 in its
    high; scale group 0 is 2^-1, group 1 is 2^3. With x one-hot at k, the output is w[k]."""
    blocks = torch.zeros(1, 1, 32, dtype=torch.uint8)
    blocks[0, 0, 0] = 0x2F  # k=0: code 15 (-6.0), k=1: code 2 (1.0)
    blocks[0, 0, 16] = 0x93  # k=32: code 3 (1.5), k=33: code 9 (-0.5)
    scales = torch.tensor([[[126, 130]]], dtype=torch.uint8)
    w = MXFP4Experts(blocks, scales)
    x = torch.eye(64)[[0, 1, 32, 33, 5]]
    ids = torch.zeros(5, 1, dtype=torch.int32)
    sorted_pairs, block_expert, num_padded = align_experts(ids, 1, 16)
    out = torch.empty(5, 1)
    cfg = dict(heuristic_config(1, 5, 1), BLOCK_N=16, BLOCK_K=32)
    from ember.kernels.moe import moe_gemm

    moe_gemm(x, w, out, sorted_pairs, block_expert, num_padded, None, 1, False, cfg)
    assert out.flatten().tolist() == [-3.0, 0.5, 12.0, -4.0, 0.0]
    assert dequantize_mxfp4(blocks.unflatten(-1, (2, 16)), scales)[0, 0, [0, 1, 32, 33, 5]].tolist() == \
        out.flatten().tolist()


def test_each_tile_config_gives_the_same_result_on_mxfp4():
    """Every heuristic tile shape (BLOCK_K 64 and 128 over K = 64: one tile, half masked) on MXFP4
    weights equals the 32-wide tiles' result, each tile's scale groups read at their own k."""
    m13, w13 = _mxfp4(4, 64, 64, "cpu", seed=3)
    m2, w2 = _mxfp4(4, 64, 32, "cpu", seed=4)
    x = torch.randn(20, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    weights, ids = route_topk(torch.randn(20, 4, generator=torch.Generator().manual_seed(4)), 2, True)
    import ember.kernels.moe as moe

    results = []
    for tokens in (1, 64, 256, 4096):
        cfg = dict(heuristic_config(4, tokens, 2), BLOCK_N=32)
        for block_k in (32, cfg["BLOCK_K"]):
            sorted_pairs, block_expert, num_padded = align_experts(ids, 4, cfg["BLOCK_M"])
            act = torch.empty(40, 32, dtype=torch.bfloat16)
            c = dict(cfg, BLOCK_K=block_k)
            moe.moe_gemm(x, m13, act, sorted_pairs, block_expert, num_padded, None, 2, True, c)
            out = torch.empty(40, 64, dtype=torch.bfloat16)
            moe.moe_gemm(act, m2, out, sorted_pairs, block_expert, num_padded, weights.reshape(-1), 1, False, c)
            results.append(out.view(20, 2, 64).float().sum(1))
    want = _loop_reference(x.float(), w13, w2, weights, ids)
    for got in results:
        torch.testing.assert_close(got, want, rtol=0, atol=2e-2 * want.abs().max().item())


def _both_passes(x, w13, w2, weights, ids, cfg, biases=None, swiglu=None):
    """fused_experts' two passes on one config: the GEMV's (cfg has GEMV) or the GEMM's."""
    import ember.kernels.moe as moe

    tokens, top_k = ids.shape
    b13, b2 = biases or (None, None)
    act = torch.empty(tokens * top_k, w2.shape[2], dtype=x.dtype, device=x.device)
    out = torch.empty(tokens * top_k, w2.shape[1], dtype=x.dtype, device=x.device)
    if cfg.get("GEMV"):
        moe.moe_gemv(x, w13, act, ids, None, top_k, True, cfg, b13, swiglu)
        moe.moe_gemv(act, w2, out, ids, weights.reshape(-1), 1, False, cfg, b2)
    else:
        layout = align_experts(ids, w13.shape[0], cfg["BLOCK_M"])
        moe.moe_gemm(x, w13, act, *layout, None, top_k, True, cfg, b13, swiglu)
        moe.moe_gemm(act, w2, out, *layout, weights.reshape(-1), 1, False, cfg, b2)
    return out.view(tokens, top_k, -1).float().sum(1)


@pytest.mark.parametrize("mxfp4", [False, True])
def test_the_gemv_pass_equals_the_gemm_pass(mxfp4):
    """The few-pairs GEMV (each pair alone: two pairs of one expert included; tiles half past N
    and K) against the GEMM on the same weights, gpt-oss's biases and clamp on: float32 to 1e-6
    of the output's scale (only the order of the k sums differs), and both against the torch
    path. MXFP4 in bfloat16: to 1e-2 of the scale (each pass rounds its output to bfloat16
    after sums in another order)."""
    dtype = torch.bfloat16 if mxfp4 else torch.float32
    inter = 64 if mxfp4 else 40  # MXFP4 rows hold whole 32-value groups
    if mxfp4:
        w13m, w13 = _mxfp4(4, 2 * inter, 96, "cpu", seed=11)
        w2m, w2 = _mxfp4(4, 96, inter, "cpu", seed=12)
    else:
        w13, w2, _ = _gpt_oss_experts(4, 96, inter, dtype, "cpu", seed=11)
        w13m, w2m = w13, w2
    _, _, biases = _gpt_oss_experts(4, 96, inter, dtype, "cpu", seed=13)
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(14)).to(dtype)
    ids = torch.tensor([[2, 0], [2, 3], [1, 2]], dtype=torch.int32)
    weights = torch.softmax(torch.randn(3, 2, generator=torch.Generator().manual_seed(15)), -1)
    gemv_cfg = {"GEMV": 1, "BLOCK_N": 64 if mxfp4 else 16, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3}
    gemv = _both_passes(x, w13m, w2m, weights, ids, gemv_cfg, biases, SWIGLU)
    gemm = _both_passes(x, w13m, w2m, weights, ids, heuristic_config(4, 64, 2), biases, SWIGLU)
    want = grouped_experts(x.float(), w13.float(), w2.float(), weights, ids.long(), tuple(b.float() for b in biases),
                           SWIGLU)
    scale = want.abs().max().item()
    tol = (1e-2 if mxfp4 else 1e-6) * scale
    torch.testing.assert_close(gemv, gemm, rtol=0, atol=tol)
    torch.testing.assert_close(gemv, want, rtol=0, atol=(2e-2 if mxfp4 else 1e-6) * scale)


def test_few_pairs_an_expert_take_the_gemv():
    """The heuristic's GEMV while at most one pair in four experts (a decode step of a few
    tokens; MXFP4 experts: one pair an expert), the 16-row GEMM beyond; fused_experts at one token of gpt-oss-like routing
    through it equals the per-token loop."""
    assert heuristic_config(128, 1, 4).get("GEMV") and heuristic_config(128, 8, 4).get("GEMV")
    assert "GEMV" not in heuristic_config(128, 9, 4) and heuristic_config(128, 9, 4)["BLOCK_M"] == 16
    assert heuristic_config(64, 2, 6).get("GEMV") and heuristic_config(8, 1, 2).get("GEMV")
    assert heuristic_config(128, 32, 4, "mxfp4").get("GEMV") and "GEMV" not in heuristic_config(128, 33, 4, "mxfp4")
    assert "GEMV" not in heuristic_config(8, 2, 2)
    w13, w2 = _experts(16, 48, 40, torch.float32, "cpu", seed=16)
    x = torch.randn(1, 48, generator=torch.Generator().manual_seed(16))
    weights, ids = route_topk(torch.randn(1, 16, generator=torch.Generator().manual_seed(17)), 4, True)
    assert moe_configs(16, 48, 40, 4, 1)[0].get("GEMV")
    torch.testing.assert_close(fused_experts(x, w13, w2, weights, ids), _loop_reference(x, w13, w2, weights, ids),
                               rtol=1e-5, atol=1e-5)


@torch.inference_mode()
def test_the_mxfp4_layer_fused_and_torch_paths_agree():
    """FusedMoE(mxfp4=True) as gpt-oss loads on CUDA: uint8 blocks and scales, the fused path
    (interpreter) against its torch path, which decodes them whole (dequantize_mxfp4)."""
    torch.manual_seed(7)
    layer = FusedMoE(64, 64, 4, 2, renormalize=True, biased=True, swiglu=SWIGLU, mxfp4=True)
    assert {n for n, _ in layer.named_parameters()} == {"gate.weight", "gate.bias", "w13_blocks", "w13_scales",
                                                         "w2_blocks", "w2_scales", "w13_bias", "w2_bias"}
    m13, w13 = _mxfp4(4, 128, 64, "cpu", seed=8)
    m2, w2 = _mxfp4(4, 64, 64, "cpu", seed=9)
    _, _, (b13, b2) = _gpt_oss_experts(4, 64, 64, torch.float32, "cpu", seed=7)
    for param, value in ((layer.w13_blocks, m13.blocks), (layer.w13_scales, m13.scales), (layer.w2_blocks, m2.blocks),
                         (layer.w2_scales, m2.scales), (layer.w13_bias, b13), (layer.w2_bias, b2)):
        param.data.copy_(value)
    layer.gate.weight.data.normal_(0, 0.3)
    layer.gate.bias.data.normal_(0, 0.5)
    x = torch.randn(9, 64)
    want = layer(x)
    with gemv_on_cpu():
        got = layer(x)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6 * want.abs().max().item())
    weights, ids = layer.route(layer.gate(x))
    torch.testing.assert_close(want, grouped_experts(x, w13, w2, weights, ids, (b13, b2), SWIGLU), rtol=0, atol=0)


def _fp8(experts, rows, cols, halves, blockwise, device, seed):
    """Random FP8 experts [E, rows, cols] as the kernels take them (values across e4m3's range;
    scales 0.5x to 1.5x of one another, so a value read with another block's or row's scale
    shows), and their dequantization (float32)."""
    g = torch.Generator(device).manual_seed(seed)
    values = (64 * torch.randn(experts, rows, cols, generator=g, device=device)).clamp(-448, 448).to(FP8)
    shape = (experts, halves * -(-(rows // halves) // 128), -(-cols // 128)) if blockwise else (experts, rows)
    w = FP8Experts(values, (0.5 + torch.rand(shape, generator=g, device=device)) / (64 * cols ** 0.5))
    return w, dequantize_experts(w.weight, w.scale, halves)


def _fp8_tensor(rows, cols, blockwise, g):
    """One checkpoint weight [rows, cols] as an FP8Tensor, scaled as _fp8's experts are."""
    values = (64 * torch.randn(rows, cols, generator=g)).clamp(-448, 448).to(FP8)
    shape = (-(-rows // 128), -(-cols // 128)) if blockwise else (rows,)
    return FP8Tensor(values, (0.5 + torch.rand(shape, generator=g)) / (64 * cols ** 0.5))


def _as_the_kernel_rounds(w, dtype, device):
    """Dequantized float32 weights in dtype, as the kernels' cast of value * scale rounds them: to
    nearest even, on the GPU as torch does, and on the interpreter as tests/kernels/conftest.py
    makes its cast do."""
    return w.to(dtype)


# BLOCK_K under, at and over a scale block's 128 (over: block scales take 128, row scales keep it);
# N tiles of 16, 64 and 32 rows over I = 136 and H = 200
FP8_TILES = {"gemv": {"GEMV": 1, "BLOCK_N": 16, "BLOCK_K": 256, "num_warps": 4, "num_stages": 3},
             "gemm-16": {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 1, "num_warps": 4, "num_stages": 4},
             "gemm-32": {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 256, "GROUP_M": 8, "num_warps": 4, "num_stages": 3}}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("blockwise", [True, False], ids=["block", "row"])
@pytest.mark.parametrize("tiles", sorted(FP8_TILES))
def test_fp8_experts_equal_the_dense_kernels_on_their_dequantized_weights(device, dtype, blockwise, tiles):
    """Both passes on FP8 experts (each value times its scale in registers) against the same
    kernels on the dequantized weights, at shapes no tile divides: 4 experts, hidden 200 (the
    gate|up's K: scale blocks of 128 and 72 columns), intermediate 136 (each half of w13 two row
    blocks, 128 and 8: the up half's blocks start at its row 0, w13's row 136; w2's K two blocks).
    The interpreter: bit for bit in float32 (the same operands reach tl.dot) and in bfloat16
    (on weights rounded as the kernel rounds them); CUDA: to 1e-2 of the output's scale. Both
    against the torch path in float32 on the dequantized weights: float32 to 1e-5 of the
    output's scale (the sums' order; measured at most 7.9e-7 on the interpreter), bfloat16 to
    3e-2 (the activations, each pass's output and the weights rounded to bfloat16; measured 1.6e-2)."""
    experts, hidden, inter, tokens, top_k = 4, 200, 136, 5, 2
    w13, d13 = _fp8(experts, 2 * inter, hidden, 2, blockwise, device, seed=1)
    w2, d2 = _fp8(experts, hidden, inter, 1, blockwise, device, seed=2)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(tokens, hidden, generator=g).to(dtype).to(device)
    ids = torch.tensor([[0, 2], [2, 3], [1, 2], [3, 0], [0, 1]], dtype=torch.int32, device=device)  # expert 2: 3 pairs
    weights = torch.softmax(torch.randn(tokens, top_k, generator=g), -1).to(device)
    cfg = FP8_TILES[tiles]
    got = _both_passes(x, w13, w2, weights, ids, cfg)
    dense_cfg = dict(cfg, BLOCK_K=min(cfg["BLOCK_K"], 128)) if blockwise else cfg
    dense = _both_passes(x, _as_the_kernel_rounds(d13, dtype, device), _as_the_kernel_rounds(d2, dtype, device),
                         weights, ids, dense_cfg)
    want = grouped_experts(x.float(), d13, d2, weights, ids.long())
    scale = want.abs().max().item()
    if device == "cpu":
        assert torch.equal(got, dense)
    else:
        torch.testing.assert_close(got, dense, rtol=0, atol=1e-2 * scale)
    print(f"{tiles} {'block' if blockwise else 'row'} {dtype}: |fp8 - torch path| max "
          f"{(got - want).abs().max().item() / scale:.2e} of the scale")
    torch.testing.assert_close(got, want, rtol=0, atol={torch.float32: 1e-5, torch.bfloat16: 3e-2}[dtype] * scale)


def test_fp8_scale_layout_by_hand():
    """dequantize_experts (the torch path's and the tests' reference) reads the module doc's
    layout: w13 [1, 2 x 136, 200] of ones with block scales 10 r + c gives its gate rows 0-127
    row block 0, rows 128-135 block 1, its up rows (136-271) blocks 2 and 3 counted from their
    own first row (a 128-row grid over all of w13 would give rows 136-255 block 1); columns 0-127
    block column 0, 128-199 column 1. And the kernels' down pass (no activation) on one-hot x
    gives out[n] = w[n, k] * scale exactly, in the GEMM's tiles and the GEMV's, per block and
    per row."""
    grid = (10 * torch.arange(4)[:, None] + torch.arange(2)[None, :]).float()
    w13 = dequantize_experts(torch.ones(1, 272, 200).to(FP8), grid[None], halves=2)[0]
    row_block = torch.tensor([0] * 128 + [1] * 8 + [2] * 128 + [3] * 8)
    col_block = torch.tensor([0] * 128 + [1] * 72)
    assert torch.equal(w13, grid[row_block][:, col_block])
    from ember.kernels.moe import moe_gemm, moe_gemv

    x = torch.eye(136)[[0, 127, 128, 135]]  # w2 [1, 200, 136]: k in blocks 0, 0, 1, 1
    ids = torch.zeros(4, 1, dtype=torch.int32)
    rows = torch.tensor([0, 127, 128, 130, 199])
    for scale, want in ((grid[None, :2], grid[:2][rows // 128][:, [0, 0, 1, 1]].t()),
                        (torch.arange(1.0, 201.0)[None], (rows + 1.0)[None].expand(4, -1))):
        w = FP8Experts(torch.ones(1, 200, 136).to(FP8), scale)
        for cfg in (dict(heuristic_config(1, 4, 1), BLOCK_N=64, BLOCK_K=64), FP8_TILES["gemv"]):
            out = torch.empty(4, 200)
            if cfg.get("GEMV"):
                moe_gemv(x, w, out, ids, None, 1, False, cfg)
            else:
                moe_gemm(x, w, out, *align_experts(ids, 1, cfg["BLOCK_M"]), None, 1, False, cfg)
            assert torch.equal(out[:, rows], want), cfg


@torch.inference_mode()
@pytest.mark.parametrize("blockwise", [True, False], ids=["block", "row"])
def test_the_fp8_layer_loads_expert_by_expert_and_equals_the_dense_layer(blockwise):
    """FusedMoE(fp8=...) as an FP8 checkpoint loads on CUDA: each expert's gate, up and down an
    FP8Tensor with its own scales (intermediate 136: the gate's and the up's second row block
    8 rows each, kept apart) into float8 w13 / w2 and float32 scales. Its torch path (the
    experts dequantized whole) and its fused path (interpreter: the GEMM at 9 tokens, the GEMV
    at 1) each equal those of a dense layer loaded with the same tensors dequantized, bit for
    bit: the same float32 weights, the same operands."""
    experts, hidden, inter = 8, 200, 136
    fp8 = FusedMoE(hidden, inter, experts, 2, renormalize=True, fp8="block" if blockwise else "row")
    dense = FusedMoE(hidden, inter, experts, 2, renormalize=True)
    assert fp8.w13.dtype == fp8.w2.dtype == FP8
    assert (fp8.w13_scale.shape, fp8.w2_scale.shape) == (((8, 4, 2), (8, 2, 2)) if blockwise else ((8, 272), (8, 200)))
    g = torch.Generator().manual_seed(21)
    dense.gate.weight.data.normal_(0, 0.3, generator=g)
    fp8.gate.weight.data.copy_(dense.gate.weight)
    for e in range(experts):
        for shard in (2 * e, 2 * e + 1):  # gate, up
            t = _fp8_tensor(inter, hidden, blockwise, g)
            fp8.load_w13(fp8.w13, t, shard)
            dense.load_w13(dense.w13, t.dequantize(), shard)
        t = _fp8_tensor(hidden, inter, blockwise, g)
        fp8.load_w2(fp8.w2, t, e)
        dense.load_w2(dense.w2, t.dequantize(), e)
    x = torch.randn(9, hidden, generator=g)
    assert torch.equal(fp8(x), dense(x))
    with gemv_on_cpu():
        assert moe_configs(experts, hidden, inter, 2, 1)[0].get("GEMV") and not moe_configs(experts, hidden, inter, 2,
                                                                                               16)[0].get("GEMV")
        for rows in (x, x[:1]):
            assert torch.equal(fp8(rows), dense(rows))


def test_the_fp8_layer_refuses_what_it_cannot_hold():
    layer = FusedMoE(200, 136, 2, 1, renormalize=True, fp8="block")
    g = torch.Generator().manual_seed(22)
    with pytest.raises(ValueError, match=r"the experts are FP8 scaled per block \(the checkpoint's quantization_config\), "
                                         r"loaded one expert's projection at a time; this tensor is row-scaled FP8"):
        layer.load_w13(layer.w13, _fp8_tensor(136, 200, False, g), 0)
    with pytest.raises(ValueError, match="this tensor is torch.float32"):
        layer.load_w2(layer.w2, torch.zeros(200, 136), 1)
    with pytest.raises(ValueError, match=r"fp8 experts are scaled per 'row' or 'block', not 'tensor'"):
        FusedMoE(200, 136, 2, 1, renormalize=True, fp8="tensor")
    with pytest.raises(ValueError, match=r"expected 4 row blocks \(each half's own, ceil\(I / 128\) a half\)"):
        fused_experts(torch.zeros(1, 200), FP8Experts(torch.zeros(2, 272, 200).to(FP8), torch.ones(2, 3, 2)),
                      FP8Experts(layer.w2, torch.ones(2, 2, 2)), torch.ones(1, 1), torch.zeros(1, 1, dtype=torch.int32))


def _int(experts, rows, cols, bits, group, symmetric, device, seed):
    """Random integer experts [E, rows, cols] as the kernels take them (every value of `bits`;
    float16 scales 0.5x to 1.5x of one another, so a value read with another group's or row's
    scale shows; zero points anywhere in range), and their dequantization in float32 by the
    definition, (q - zero) * scale of column k's group k // group."""
    g = torch.Generator(device).manual_seed(seed)
    group = cols if group == -1 else min(group, cols)
    groups = -(-cols // group)
    q = torch.randint(0, 1 << bits, (experts, rows, cols), generator=g, device=device, dtype=torch.int32)
    scales = ((0.5 + torch.rand(experts, rows, groups, generator=g, device=device)) * 2 ** (2 - bits) /
              cols ** 0.5).half()
    zeros = None if symmetric else torch.randint(0, 1 << bits, (experts, rows, groups), generator=g, device=device,
                                                 dtype=torch.int32).to(torch.uint8)
    col_group = torch.arange(cols, device=device) // group
    zero = float(1 << (bits - 1)) if symmetric else zeros.float()[..., col_group]
    dequantized = (q.float() - zero) * scales.float()[..., col_group]
    return IntExperts(pack_words(q.to(torch.uint8), bits), scales, zeros, bits, group, cols), dequantized


# (bits, group size, symmetric): AWQ's 4 bits with zero points, GPTQ's and compressed-tensors'
# symmetric forms, 8 bits with zero points (GPTQ asym); over hidden 160 (groups of 32 and 64: 5
# and 2.5 a row) and intermediate 72 (groups of 32 and 64 end in a part-group; 128: one a row)
INT_FORMS = {"int4-g32-zeros": (4, 32, False), "int4-g128": (4, 128, True), "int4-channel": (4, -1, True),
             "int8-g64": (8, 64, True), "int8-g128-zeros": (8, 128, False)}
INT_TILES = {"gemv": ({"GEMV": 1, "BLOCK_N": 32, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3}, 3),
             "gemm": ({"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 128, "GROUP_M": 1, "num_warps": 4, "num_stages": 4},
                      7)}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tiles", sorted(INT_TILES))
@pytest.mark.parametrize("form", sorted(INT_FORMS))
def test_int_experts_match_the_per_token_loop_on_their_dequantized_weights(device, form, tiles):
    """Both passes on packed integer experts (unpacked and scaled in registers, BLOCK_K cut to
    the group) against the definition token by token on the dequantized weights, float32:
    to 1e-5 of the output's scale (the sums' order; the GEMM scales its integer dot once a
    group). The GEMV at 3 tokens, the 16-row GEMM at 7, top-2 of 4 experts: experts with
    several pairs, one with none."""
    bits, group, symmetric = INT_FORMS[form]
    experts, hidden, inter, top_k = 4, 160, 72, 2
    cfg, tokens = INT_TILES[tiles]
    w13, d13 = _int(experts, 2 * inter, hidden, bits, group, symmetric, device, seed=1)
    w2, d2 = _int(experts, hidden, inter, bits, group, symmetric, device, seed=2)
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=g).to(device)
    ids = torch.tensor([[0, 2], [2, 1], [1, 2], [0, 1], [2, 0], [1, 0], [0, 2]][:tokens], dtype=torch.int32,
                       device=device)
    weights = torch.softmax(torch.randn(tokens, top_k, generator=g), -1).to(device)
    got = _both_passes(x, w13, w2, weights, ids, cfg)
    want = _loop_reference(x.cpu(), d13.cpu(), d2.cpu(), weights.cpu(), ids.cpu())
    scale = want.abs().max().item()
    print(f"{form} {tiles}: max |diff| {(got.cpu() - want).abs().max().item() / scale:.1e} of the scale")
    torch.testing.assert_close(got.cpu(), want, rtol=0, atol=1e-5 * scale)


@pytest.mark.parametrize("device", DEVICES)
def test_int_experts_in_bfloat16_through_fused_experts(device):
    """fused_experts on 4-bit experts with zero points in bfloat16 (the GEMV at one token of
    8 experts' top-2, the GEMM at 9), against the torch path in float32 on the dequantized
    weights: to 2e-2 of the output's scale (the activations and each pass's output rounded to
    bfloat16; q - zero is exact in bfloat16)."""
    w13, d13 = _int(8, 2 * 72, 160, 4, 32, False, device, seed=3)
    w2, d2 = _int(8, 160, 72, 4, 32, False, device, seed=4)
    g = torch.Generator().manual_seed(5)
    for tokens in (1, 9):
        x = torch.randn(tokens, 160, generator=g).to(torch.bfloat16).to(device)
        weights, ids = route_topk(torch.randn(tokens, 8, generator=g).to(device), 2, True)
        assert bool(moe_configs(8, 160, 72, 2, tokens, "", "int4")[0].get("GEMV")) == (tokens == 1)
        got = fused_experts(x, w13, w2, weights, ids)
        want = grouped_experts(x.float(), d13, d2, weights, ids.long())
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want, rtol=0, atol=2e-2 * want.abs().max().item())


def test_int_layout_by_hand():
    """The kernels read the layout IntTensor packs: value k of a row at bits (k % 8) * 4 of word
    k // 8, the scale and zero of its group. One expert's down pass (no activation) on one-hot x
    gives (q - zero) * scale of that column exactly, in the GEMM's tiles and the GEMV's."""
    q = (torch.arange(3 * 64) % 16).view(1, 3, 64).to(torch.uint8)  # row r, column k: (64 r + k) % 16
    scales = torch.tensor([[[0.5, 2.0], [0.25, 1.0], [4.0, 0.125]]], dtype=torch.float16)
    zeros = torch.tensor([[[8, 3], [0, 15], [7, 8]]], dtype=torch.uint8)
    w = IntExperts(pack_words(q, 4), scales, zeros, 4, 32, 64)
    assert w.qweight[0, 0, 1].item() == int("fedcba98", 16) - 2 ** 32  # k = 8 .. 15, low nibble first
    cols = torch.tensor([0, 9, 31, 32, 40, 63])
    x = torch.eye(64)[cols]
    ids = torch.zeros(len(cols), 1, dtype=torch.int32)
    want = ((q[0].float() - zeros[0].float().repeat_interleave(32, 1)) * scales[0].float().repeat_interleave(32, 1))
    from ember.kernels.moe import moe_gemm, moe_gemv

    for cfg in (dict(heuristic_config(1, 6, 1), BLOCK_N=16, BLOCK_K=64), INT_TILES["gemv"][0]):
        out = torch.empty(len(cols), 3)
        if cfg.get("GEMV"):
            moe_gemv(x, w, out, ids, None, 1, False, cfg)
        else:
            moe_gemm(x, w, out, *align_experts(ids, 1, cfg["BLOCK_M"]), None, 1, False, cfg)
        assert torch.equal(out, want[:, cols].t()), cfg


def _int_tensor(rows, cols, bits, group, symmetric, g, scale_dtype=torch.float16):
    """One checkpoint weight [rows, cols] as an IntTensor (a random weight rounded to nearest)."""
    t = quantize_int(torch.randn(rows, cols, generator=g) / cols ** 0.5, bits, group, symmetric)
    return IntTensor(t.qweight, t.scales.to(scale_dtype), t.zeros, None, bits, t.group_size, cols)


@torch.inference_mode()
def test_the_int_layer_loads_expert_by_expert_and_equals_the_dense_layer():
    """FusedMoE(int_experts=...) as an integer checkpoint loads on CUDA: each expert's gate, up
    and down an IntTensor (bfloat16 scales: the layer takes the first expert's dtype) into int32
    w13 / w2 with their scales and zeros, the packed bytes. Its torch path (the experts
    dequantized whole) equals a dense layer loaded with the same tensors dequantized, bit for
    bit; its fused path (interpreter: the GEMV at 1 token, the GEMM at 9) to 1e-5 of the
    output's scale."""
    bits, group, symmetric = INT_FORMS["int4-g32-zeros"]
    experts, hidden, inter = 8, 160, 72
    layer = FusedMoE(hidden, inter, experts, 2, renormalize=True, int_experts=(bits, group, symmetric))
    dense = FusedMoE(hidden, inter, experts, 2, renormalize=True)
    assert layer.w13.dtype == layer.w2.dtype == torch.int32
    g = torch.Generator().manual_seed(23)
    dense.gate.weight.data.normal_(0, 0.3, generator=g)
    layer.gate.weight.data.copy_(dense.gate.weight)
    for e in range(experts):
        for shard in (2 * e, 2 * e + 1):  # gate, up
            t = _int_tensor(inter, hidden, bits, group, symmetric, g, torch.bfloat16)
            layer.load_w13(layer.w13, t, shard)
            dense.load_w13(dense.w13, t.dequantize(), shard)
        t = _int_tensor(hidden, inter, bits, group, symmetric, g, torch.bfloat16)
        layer.load_w2(layer.w2, t, e)
        dense.load_w2(dense.w2, t.dequantize(), e)
    assert layer.w13_scales.dtype == torch.bfloat16 and hasattr(layer, "w13_zeros") != symmetric
    # int32 words of 32 / bits values, a bfloat16 scale (and a uint8 zero) a group
    packed = experts * sum(rows * (-(-cols // (32 // bits)) * 4 + -(-cols // group) * (2 + (not symmetric)))
                           for rows, cols in ((2 * inter, hidden), (hidden, inter)))
    assert sum(p.nbytes for n, p in layer.named_parameters() if n.startswith(("w13", "w2"))) == packed
    x = torch.randn(9, hidden, generator=g)
    assert torch.equal(layer(x), dense(x))
    with gemv_on_cpu():
        for rows in (x, x[:1]):
            want = dense(rows)
            torch.testing.assert_close(layer(rows), want, rtol=0, atol=1e-5 * want.abs().max().item())


def test_the_int_layer_refuses_what_it_cannot_hold():
    layer = FusedMoE(160, 72, 2, 1, renormalize=True, int_experts=(4, 32, True))
    g = torch.Generator().manual_seed(24)
    with pytest.raises(ValueError, match=r"the experts are 4-bit integers \(the checkpoint's quantization_config\), "
                                         r"loaded one expert's projection at a time; this tensor is torch.float32 "
                                         r"\(quantization='none' loads the experts dequantized\)"):
        layer.load_w13(layer.w13, torch.zeros(72, 160), 0)
    with pytest.raises(ValueError, match=r"the experts are 4-bit integers in groups of 32 columns in order, symmetric "
                                         r"\(the checkpoint's quantization_config\); this tensor is 8-bit in groups "
                                         r"of 32: load the model with quantization='none'"):
        layer.load_w2(layer.w2, _int_tensor(160, 72, 8, 32, True, g), 0)
    with pytest.raises(ValueError, match=r"this tensor is 4-bit in groups of 32, with zero points"):
        layer.load_w2(layer.w2, _int_tensor(160, 72, 4, 32, False, g), 0)
    t = _int_tensor(72, 160, 4, 32, True, g)
    shuffled = IntTensor(t.qweight, t.scales, None, torch.randperm(160, generator=g).to(torch.int32) // 32, 4, 32, 160)
    with pytest.raises(ValueError, match=r"this tensor is 4-bit in groups of 32, act-order \(g_idx\)"):
        layer.load_w13(layer.w13, shuffled, 1)
    layer.load_w13(layer.w13, t, 0)
    with pytest.raises(ValueError, match=r"experts whose scales are torch.float16 and torch.bfloat16"):
        layer.load_w13(layer.w13, _int_tensor(72, 160, 4, 32, True, g, torch.bfloat16), 1)
    with pytest.raises(ValueError, match=r"experts are integer, MXFP4 or FP8, one of them"):
        FusedMoE(160, 72, 2, 1, renormalize=True, fp8="row", int_experts=(4, 32, True))
    with pytest.raises(ValueError, match=r"the fused MoE kernels take groups that are multiples of 16"):
        w, _ = _int(2, 144, 160, 4, 40, True, "cpu", seed=0)
        fused_experts(torch.zeros(1, 160), w, w, torch.ones(1, 1), torch.zeros(1, 1, dtype=torch.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("tokens,experts,top_k,hidden,inter,gpt_oss", [
    (1, 128, 8, 2048, 768, False), (512, 128, 8, 2048, 768, False), (3000, 8, 2, 4096, 1024, False),
    (1, 32, 4, 2880, 2880, True), (300, 32, 4, 2880, 2880, True)])  # gpt-oss-20b's experts, biased and clamped
def test_fused_experts_at_real_shapes_and_in_a_cuda_graph(tokens, experts, top_k, hidden, inter, gpt_oss):
    w13, w2 = _experts(experts, hidden, inter, torch.bfloat16, "cuda")
    layer = FusedMoE(hidden, inter, experts, top_k, renormalize=True, biased=gpt_oss,
                     swiglu=SWIGLU if gpt_oss else None).cuda().to(torch.bfloat16)
    layer.w13.data.copy_(w13)
    layer.w2.data.copy_(w2)
    layer.gate.weight.data.normal_(0, 0.05)
    biases = None
    if gpt_oss:
        layer.gate.bias.data.normal_(0, 0.5)
        layer.w13_bias.data.normal_(0, 0.5)
        layer.w2_bias.data.normal_(0, 0.5)
        biases = (layer.w13_bias.float(), layer.w2_bias.float())
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    weights, ids = route_topk(layer.gate(x), top_k, True)
    want = grouped_experts(x.float(), w13.float(), w2.float(), weights, ids.long(), biases, layer.swiglu)
    eager = layer(x)
    torch.testing.assert_close(eager.float(), want, rtol=2e-2, atol=2e-2)
    _assert_graph_replays(layer, x)


def _assert_graph_replays(layer: FusedMoE, x: torch.Tensor) -> None:
    """The layer captured in a CUDA graph on a copy of x, replayed on new tokens (which route
    elsewhere: the graph must follow), gives what it gives eager, bit for bit."""
    static = x.clone()
    assert_graph_replays(lambda: layer(static), [static], [torch.randn_like(x)])


@pytest.fixture(scope="module")
def gpt_oss_120b_experts():
    """gpt-oss-120b's expert weights as random MXFP4 on the GPU and decoded (float32): 128
    experts of hidden 2880, intermediate 2880."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    m13, w13 = _mxfp4(128, 2 * 2880, 2880, "cuda", seed=1, exponents=(118, 121))
    m2, w2 = _mxfp4(128, 2880, 2880, "cuda", seed=2, exponents=(118, 121))
    return m13, w13, m2, w2


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 64, 1024])
@torch.inference_mode()
def test_mxfp4_experts_at_gpt_oss_120b_shapes_and_in_a_cuda_graph(tokens, gpt_oss_120b_experts):
    """gpt-oss-120b's experts (128 of hidden 2880, intermediate 2880, top-4; biased, clamped) as
    MXFP4 in the layer on CUDA, against the torch path in float32 on the weights
    dequantize_mxfp4 decodes, and against the bf16 kernels on those decoded weights (the same
    operands reach tl.dot: equal up to the compiled kernels' own order); replayed in a graph."""
    experts, hidden, inter, top_k = 128, 2880, 2880, 4
    m13, w13, m2, w2 = gpt_oss_120b_experts
    layer = FusedMoE(hidden, inter, experts, top_k, renormalize=True, biased=True, swiglu=SWIGLU,
                     mxfp4=True).cuda().to(torch.bfloat16)
    for param, value in ((layer.w13_blocks, m13.blocks), (layer.w13_scales, m13.scales), (layer.w2_blocks, m2.blocks),
                         (layer.w2_scales, m2.scales)):
        param.data.copy_(value)
    for p in (layer.gate.weight, layer.gate.bias, layer.w13_bias, layer.w2_bias):
        p.data.normal_(0, 0.05 if p is layer.gate.weight else 0.5)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    weights, ids = route_topk(layer.gate(x), top_k, True)
    biases = (layer.w13_bias.float(), layer.w2_bias.float())
    want = grouped_experts(x.float(), w13, w2, weights, ids.long(), biases, SWIGLU)
    eager = layer(x)
    scale = want.abs().max().item()
    torch.testing.assert_close(eager.float(), want, rtol=0, atol=2e-2 * scale)
    dense = fused_experts(x, w13.to(torch.bfloat16), w2.to(torch.bfloat16), weights, ids,
                          (layer.w13_bias, layer.w2_bias), SWIGLU)
    torch.testing.assert_close(eager, dense, rtol=0, atol=1e-2 * scale)
    _assert_graph_replays(layer, x)


# real experts' shapes: (experts, hidden, intermediate, top_k), FP8 scales per block or per row
FP8_SHAPES = {"qwen3-30b-a3b-block": (128, 2048, 768, 8, True), "qwen3-30b-a3b-row": (128, 2048, 768, 8, False),
              "deepseek-v3-32-experts": (32, 7168, 2048, 8, True)}


@pytest.fixture(scope="module", params=sorted(FP8_SHAPES))
def fp8_experts_on_gpu(request):
    """FP8 experts of a real shape on the GPU (DeepSeek-V3's 256 experts cut to 32: their
    float32 reference would not fit beside them), and their float32 dequantization."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    experts, hidden, inter, top_k, blockwise = FP8_SHAPES[request.param]
    w13, d13 = _fp8(experts, 2 * inter, hidden, 2, blockwise, "cuda", seed=1)
    w2, d2 = _fp8(experts, hidden, inter, 1, blockwise, "cuda", seed=2)
    return (experts, hidden, inter, top_k, blockwise), w13, d13, w2, d2


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 64, 1024])
@torch.inference_mode()
def test_fp8_experts_at_real_shapes_and_in_a_cuda_graph(tokens, fp8_experts_on_gpu):
    """FusedMoE(fp8=...) on CUDA at Qwen3-30B-A3B's and DeepSeek-V3's expert shapes (the GEMV at
    1 token, the GEMMs at 64 and 1024), against the torch path in float32 on the dequantized
    weights (to 2e-2 of the output's scale, as the interpreter's 1.6e-2), and against the
    dense bf16 kernels on the weights dequantized to bf16 (the same operands reach tl.dot:
    equal up to the compiled kernels' own order, to 1e-2); replayed in a CUDA graph."""
    (experts, hidden, inter, top_k, blockwise), w13, d13, w2, d2 = fp8_experts_on_gpu
    with torch.device("cuda"):
        layer = FusedMoE(hidden, inter, experts, top_k, renormalize=True, fp8="block" if blockwise else "row")
    layer.gate.to(torch.bfloat16).weight.data.normal_(0, 0.05)
    for param, value in ((layer.w13, w13.weight), (layer.w13_scale, w13.scale), (layer.w2, w2.weight),
                         (layer.w2_scale, w2.scale)):
        param.data.copy_(value)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    weights, ids = route_topk(layer.gate(x), top_k, True)
    assert bool(moe_configs(experts, hidden, inter, top_k, tokens)[0].get("GEMV")) == (tokens == 1)
    eager = layer(x)
    want = grouped_experts(x.float(), d13, d2, weights, ids.long())
    scale = want.abs().max().item()
    print(f"E={experts} H={hidden} I={inter} T={tokens} {'block' if blockwise else 'row'}: |fp8 - torch path| max "
          f"{(eager.float() - want).abs().max().item() / scale:.2e} of the scale")
    torch.testing.assert_close(eager.float(), want, rtol=0, atol=2e-2 * scale)
    dense = fused_experts(x, d13.to(torch.bfloat16), d2.to(torch.bfloat16), weights, ids)
    torch.testing.assert_close(eager, dense, rtol=0, atol=1e-2 * scale)
    _assert_graph_replays(layer, x)


# real experts' shapes (experts, hidden, intermediate, top_k) in their common integer forms
INT_SHAPES = {"mixtral-8x7b-awq": ((8, 4096, 14336, 2), "int4-g128-zeros"),
              "qwen3-30b-a3b-gptq": ((128, 2048, 768, 8), "int4-g128"),
              "qwen3-30b-a3b-w8a16": ((128, 2048, 768, 8), "int8-channel")}
INT_FORMS_GPU = {"int4-g128-zeros": (4, 128, False), "int4-g128": (4, 128, True), "int8-channel": (8, -1, True)}


@pytest.fixture(scope="module", params=sorted(INT_SHAPES))
def int_experts_on_gpu(request):
    """Integer experts of a real shape on the GPU, and their float32 dequantization."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    (experts, hidden, inter, top_k), form = INT_SHAPES[request.param]
    bits, group, symmetric = INT_FORMS_GPU[form]
    w13, d13 = _int(experts, 2 * inter, hidden, bits, group, symmetric, "cuda", seed=1)
    w2, d2 = _int(experts, hidden, inter, bits, group, symmetric, "cuda", seed=2)
    return (experts, hidden, inter, top_k, (bits, group, symmetric)), w13, d13, w2, d2


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 64, 1024])
@torch.inference_mode()
def test_int_experts_at_real_shapes_and_in_a_cuda_graph(tokens, int_experts_on_gpu):
    """FusedMoE(int_experts=...) on CUDA at Mixtral-8x7B's (AWQ) and Qwen3-30B-A3B's (GPTQ
    4-bit, W8A16 per channel) expert shapes, the GEMV at one token and the GEMMs at 64 and
    1024, against the torch path in float32 on the dequantized weights (to 2e-2 of the output's
    scale: the activations and each pass's output in bfloat16) and against the dense bf16
    kernels on the weights dequantized to bfloat16 (to 1e-2: those round each weight, the
    integer kernels scale exact sums); replayed in a CUDA graph."""
    (experts, hidden, inter, top_k, scheme), w13, d13, w2, d2 = int_experts_on_gpu
    with torch.device("cuda"):
        layer = FusedMoE(hidden, inter, experts, top_k, renormalize=True, int_experts=scheme)
    layer.gate.to(torch.bfloat16).weight.data.normal_(0, 0.05)
    for name, w in (("w13", w13), ("w2", w2)):
        getattr(layer, name).data.copy_(w.qweight)
        getattr(layer, f"{name}_scales").data = w.scales
        if w.zeros is not None:
            getattr(layer, f"{name}_zeros").data.copy_(w.zeros)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    weights, ids = route_topk(layer.gate(x), top_k, True)
    assert bool(moe_configs(experts, hidden, inter, top_k, tokens, "", f"int{scheme[0]}")[0].get("GEMV")) == \
        (tokens == 1)
    eager = layer(x)
    want = grouped_experts(x.float(), d13, d2, weights, ids.long())
    scale = want.abs().max().item()
    print(f"E={experts} H={hidden} I={inter} T={tokens} {scheme}: |int - torch path| max "
          f"{(eager.float() - want).abs().max().item() / scale:.2e} of the scale")
    torch.testing.assert_close(eager.float(), want, rtol=0, atol=2e-2 * scale)
    dense = fused_experts(x, d13.to(torch.bfloat16), d2.to(torch.bfloat16), weights, ids)
    torch.testing.assert_close(eager, dense, rtol=0, atol=1e-2 * scale)
    _assert_graph_replays(layer, x)


_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from ember.kernels.moe import _moe_gemm_kernel, _moe_gemv_kernel

# WEIGHTS 1: MXFP4 (uint8 blocks and scales); 2, 3: FP8 values with float32 scales per row, per block;
# 4: 4-bit integers in int32 words with float16 scales and uint8 zeros a group of 128
VALUES = {1: ("*u8", "*u8", "*u8"), 2: ("*fp8e4nv", "*fp32", "*fp32"), 3: ("*fp8e4nv", "*fp32", "*fp32"),
          4: ("*i32", "*fp16", "*u8")}
for kernel in (_moe_gemm_kernel, _moe_gemv_kernel):
    names = list(kernel.arg_names)
    for weights, (w, s, z) in VALUES.items():
        pointers = {"a_ptr": "*bf16", "w_ptr": w, "s_ptr": s, "z_ptr": z, "c_ptr": "*bf16", "sorted_ptr": "*i32",
                    "block_expert_ptr": "*i32", "num_padded_ptr": "*i32", "ids_ptr": "*i32", "weights_ptr": "*fp32",
                    "bias_ptr": "*bf16"}
        for gated in (True, False):
            constants = dict(GATED=gated, WEIGHTED=not gated, BIASED=True, ACTIVATION=int(gated), WEIGHTS=weights,
                             BITS=4, GROUP=128 if weights == 4 else 1, HAS_ZEROS=weights == 4 and gated,
                             BLOCK_N=64, BLOCK_K=128 if weights > 1 else 256)
            if kernel is _moe_gemm_kernel:
                constants |= dict(IEEE=False, BLOCK_M=16, GROUP_M=1)
            signature = {n: pointers.get(n, "fp32" if n in ("alpha", "limit") else "constexpr" if n in constants
                                         else "i32") for n in names}
            source = ASTSource(kernel, signature, {(names.index(k),): v for k, v in constants.items()})
            compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 3})
            if kernel is _moe_gemm_kernel:
                assert "mma" in compiled.asm["ptx"], f"no tensor-core instruction in the PTX (WEIGHTS {weights})"
            assert compiled.metadata.shared <= 232448, f"{compiled.metadata.shared} bytes of shared memory (H100: 227 KiB)"
print("compiled")
"""


@pytest.mark.slow
def test_the_quantized_kernels_compile_for_hopper():
    """The interpreter runs what a compiled kernel may refuse (a global as a constexpr, an
    integer type a GPU op does not take): Triton compiles the GEMM's and the GEMV's gate|up and
    down passes on MXFP4, FP8 (per-row and block scales) and 4-bit integer experts (with zero
    points and without), with biases and the clamp, to sm_90 PTX here, without a GPU, within
    the H100's shared memory, and the GEMM's use tensor cores."""
    assert "compiled" in run_compile_script(_COMPILE)
