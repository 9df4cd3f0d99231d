"""Qwen3-Next's gated DeltaNet on its kernels (kernels/causal_conv.py, delta_rule_decode.py,
delta_rule_chunk.py: the layer's CUDA path, GatedDeltaNet._kernels) against the layer's torch
path (GatedDeltaNet._torch: the CPU's), step after step from random states: prefills of several
lengths across chunk boundaries, decode steps, mixed steps, shuffled slots, gates at their
extremes (no decay and a full reset, beta 0 and 1), and a CUDA graph's padded rows (slot -1),
which must write no slot. CPU: Triton's interpreter at small odd shapes, float32; `-m gpu`:
Qwen3-Next-80B-A3B's shapes (16 key heads, 32 value heads of 128 dims, conv kernel 4), a decode
step replayed in a CUDA graph, and no host sync on the way."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from graph_replay import assert_graph_replays  # noqa: E402
from hopper_compile import run_compile_script  # noqa: E402

from ember import LLM, SamplingParams  # noqa: E402
from ember.layers.attention import AttentionMetadata  # noqa: E402
from ember.layers.kernel_paths import gemv_on_cpu  # noqa: E402
from ember.models.config import ModelConfig  # noqa: E402
from ember.models.gated_deltanet import GatedDeltaNet  # noqa: E402

SMALL = dict(key_heads=2, heads=6, dk=16, dv=24)  # 3 value heads a key head, dv no power of two
REAL = dict(key_heads=16, heads=32, dk=128, dv=128)  # Qwen3-Next-80B-A3B
SLOTS = 8
# float32, the kernels against the torch path, on states and inputs of order 1: the largest
# differences measured on the interpreter over STEPS were 1.2e-7 (o) and 2.4e-7 (the recurrent
# state; the conv state is equal); the bound leaves room for CUDA's own order of sums at 128
# dims (the GPU run prints what it measures)
F32_TOL = dict(rtol=2e-5, atol=2e-5)


def _layer(device: str, dtype: torch.dtype, key_heads: int, heads: int, dk: int, dv: int,
           seed: int = 0) -> GatedDeltaNet:
    """A layer of random weights and random states in SLOTS slots. Head 0 never decays and
    never writes (A_log -> g = 0; the inputs set beta = 0, see _inputs); head 1 forgets its
    state every token (g = -16 * 200); the others decay as a trained model's (A in 1 .. 16)."""
    hidden = 64
    cfg = ModelConfig(architecture="qwen3_next", vocab_size=64, hidden_size=hidden, intermediate_size=64, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=16, rms_norm_eps=1e-6, rope_theta=1e4,
                      max_position_embeddings=4096, tie_word_embeddings=False, linear_layers=(True,),
                      linear_num_key_heads=key_heads, linear_num_value_heads=heads, linear_key_head_dim=dk,
                      linear_value_head_dim=dv, linear_conv_kernel=4)
    gen = torch.Generator().manual_seed(seed)
    layer = GatedDeltaNet(cfg)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
        layer.conv1d.weight.copy_(0.4 * torch.randn(layer.conv1d.weight.shape, generator=gen))
        a_log = torch.empty(heads).uniform_(1, 16, generator=gen).log()
        a_log[0], a_log[1] = -200.0, math.log(16)  # exp(-200) = 0 in float32: g = 0
        layer.A_log.copy_(a_log)
        layer.dt_bias.copy_(1 + 0.3 * torch.randn(heads, generator=gen))
        layer.norm.weight.copy_(1 + 0.1 * torch.randn(dv, generator=gen))
    layer = layer.to(device=device, dtype=dtype)
    conv, recurrent = layer.state_shapes
    layer.conv_state = torch.randn(SLOTS, *conv, generator=gen).to(device=device, dtype=dtype)
    layer.recurrent_state = (0.5 * torch.randn(SLOTS, *recurrent, generator=gen)).to(device)
    return layer


def _meta(lens: list[int], slots: list[int], device: str) -> AttentionMetadata:
    starts = np.concatenate([[0], np.cumsum(lens)]).tolist()
    tokens = starts[-1]
    return AttentionMetadata(
        slot_mapping=torch.full((tokens,), -1, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        block_tables=torch.zeros(len(lens), 1, dtype=torch.int32, device=device),
        query_lens_cpu=lens, seq_lens_cpu=lens, state_slots=torch.tensor(slots, device=device),
        state_slots_cpu=slots)


def _inputs(layer: GatedDeltaNet, tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [T, conv_dim] (a strided view, as the projection's split gives it), a, b [T, H]; b
    sets head 0's beta to 0 and head 1's to 1, a pushes head 1's softplus to 200."""
    gen = torch.Generator().manual_seed(seed)
    device, dtype = layer.conv_state.device, layer.conv_state.dtype
    qkv = torch.randn(tokens, layer.conv_dim + layer.value_dim, generator=gen)[:, :layer.conv_dim]
    ba = torch.randn(tokens, 2 * layer.heads, generator=gen)
    b, a = ba[:, :layer.heads], ba[:, layer.heads:]
    b[:, 0], b[:, 1], a[:, 1] = -200.0, 200.0, 200.0
    return qkv.to(device, dtype), a.to(device, dtype), b.to(device, dtype)


def _both_paths(layer: GatedDeltaNet, lens: list[int], slots: list[int], seed: int):
    """One step on the kernels and on the torch path from the same states: (o and the states
    after it) on each."""
    device = layer.conv_state.device
    qkv, a, b = _inputs(layer, sum(lens), seed)
    meta = _meta(lens, slots, device)
    start = layer.conv_state.clone(), layer.recurrent_state.clone()
    got = layer._kernels(qkv, a, b, meta), layer.conv_state.clone(), layer.recurrent_state.clone()
    layer.conv_state, layer.recurrent_state = start
    want = layer._torch(qkv, a, b, meta), layer.conv_state, layer.recurrent_state
    return got, want


# (lens, slots) step after step: prefills across 64-token chunk boundaries beside a one-token
# prompt, decode steps, then a mixed step (decode rows, a new prompt, a chunk carried on)
STEPS = [([3, 1, 70, 2, 130], [5, 0, 2, 7, 3]), ([1] * 5, [5, 0, 2, 7, 3]), ([1] * 5, [5, 0, 2, 7, 3]),
         ([1, 40, 1, 2, 1], [5, 1, 2, 7, 3]), ([64, 1, 257], [4, 2, 6])]


def _close_in_float32(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got.float(), want.float(), **F32_TOL)


def _close_in_bfloat16(got: torch.Tensor, want: torch.Tensor) -> None:
    """Where one path rounds a conv output to the other side of a bfloat16 step, q, k or v moves
    by 2^-8 of itself and everything after it by as much: a relative bound on the whole."""
    err = ((got.float() - want.float()).norm() / want.float().norm()).item()
    assert err < 1e-2, err


def _check_steps(device: str, dtype: torch.dtype, shape: dict) -> None:
    close = _close_in_float32 if dtype == torch.float32 else _close_in_bfloat16
    layer = _layer(device, dtype, **shape)
    worst = [0.0, 0.0]
    for i, (lens, slots) in enumerate(STEPS):
        (o, conv, rec), (want_o, want_conv, want_rec) = _both_paths(layer, lens, slots, seed=i)
        assert o.dtype == dtype and o.shape == want_o.shape
        assert torch.equal(conv, want_conv), i  # the conv state holds inputs: copied, never computed
        close(o, want_o)
        close(rec, want_rec)
        worst = [max(w, (x.float() - y.float()).abs().max().item()) for w, x, y in
                 zip(worst, (o, rec), (want_o, want_rec))]
        layer.conv_state, layer.recurrent_state = conv, rec  # on from the kernels' states
    print(f"{device} {dtype}: largest |kernels - torch| o {worst[0]:.3g}, recurrent state {worst[1]:.3g}")


def test_the_kernels_follow_the_torch_path_step_after_step():
    _check_steps("cpu", torch.float32, SMALL)


def test_padded_rows_write_no_slot():
    """A decode step as a CUDA graph pads it: rows of slot -1 give o = 0 and leave every slot
    as it was; the real rows are what they are alone."""
    layer = _layer("cpu", torch.float32, **SMALL)
    start = layer.conv_state.clone(), layer.recurrent_state.clone()
    qkv, a, b = _inputs(layer, 4, seed=9)
    o = layer._kernels(qkv, a, b, _meta([1] * 4, [3, -1, 0, -1], "cpu"))
    got = layer.conv_state.clone(), layer.recurrent_state.clone()
    layer.conv_state, layer.recurrent_state = start
    rows = torch.tensor([0, 2])
    want = layer._torch(qkv[rows], a[rows], b[rows], _meta([1, 1], [3, 0], "cpu"))
    assert torch.equal(o[1], torch.zeros_like(o[1])) and torch.equal(o[3], torch.zeros_like(o[3]))
    torch.testing.assert_close(o[rows], want, **F32_TOL)
    assert torch.equal(got[0], layer.conv_state)
    untouched = [1, 2, 4, 5, 6, 7]
    assert torch.equal(got[1][untouched], start[1][untouched])
    torch.testing.assert_close(got[1], layer.recurrent_state, **F32_TOL)
    # nor does a longer sequence of slot -1 (the chunked path's guard; no step makes one)
    layer.conv_state, layer.recurrent_state = (s.clone() for s in start)
    qkv, a, b = _inputs(layer, 70, seed=10)
    layer._kernels(qkv, a, b, _meta([1, 69], [-1, -1], "cpu"))
    assert torch.equal(layer.conv_state, start[0]) and torch.equal(layer.recurrent_state, start[1])


# a tiny Qwen3-Next: three linear-attention layers (dense MLPs) and a full one (experts)
TINY = {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "vocab_size": 320, "hidden_size": 64,
        "intermediate_size": 96, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "rms_norm_eps": 1e-6, "max_position_embeddings": 512, "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 16,
        "linear_value_head_dim": 24, "linear_num_key_heads": 2, "linear_num_value_heads": 6, "num_experts": 4,
        "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48,
        "norm_topk_prob": True, "tie_word_embeddings": False, "mlp_only_layers": [0, 1, 2]}


def test_the_engine_on_the_kernels_gives_the_torch_paths_tokens(tmp_path, monkeypatch):
    """The whole engine on the CUDA paths (these kernels and every other the model takes, through
    Triton's interpreter) against its torch path, on the same weights: the runner's slots, a
    step's chunk layout shared by the layers, a first step of four prompts (one of one token),
    then mixed steps of decode rows and a 116-token chunk across a 64-token boundary. Same greedy
    tokens, logprobs within float32 rounding (of logits 50 times the dummy's)."""
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    monkeypatch.setattr("ember.runner.model_runner.cpu_packing_supported", lambda dtype: False)  # GEMV's weights
    llm = LLM(str(tmp_path), load_format="dummy", seed=3, dtype="float32", num_kv_blocks=64, block_size=8,
              max_model_len=256, max_num_seqs=4, max_num_batched_tokens=128)
    gen = torch.Generator().manual_seed(5)
    model = llm.engine.runner.model
    with torch.no_grad():  # the linear-attention layers at a trained model's scales, not the dummy's 0.02,
        model.lm_head.weight.mul_(50)  # and logits far from flat
        for layer in model.linear_attention_layers():
            for p in (layer.in_proj_qkvz.weight, layer.in_proj_ba.weight, layer.out_proj.weight):
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1]))
            layer.conv1d.weight.copy_(0.4 * torch.randn(layer.conv1d.weight.shape, generator=gen))
            layer.A_log.copy_(torch.empty(layer.heads).uniform_(1, 16, generator=gen).log())
            layer.dt_bias.copy_(1 + 0.3 * torch.randn(layer.heads, generator=gen))
    prompts = [{"prompt_token_ids": torch.randint(3, 320, (n,), generator=gen).tolist()} for n in (3, 1, 90, 150)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    want = llm.generate(prompts, params)
    with gemv_on_cpu():
        got = llm.generate(prompts, params)
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        lp = [[d[t].logprob for t, d in zip(o.token_ids, o.logprobs)] for o in (g.outputs[0], w.outputs[0])]
        torch.testing.assert_close(torch.tensor(lp[0]), torch.tensor(lp[1]), rtol=0, atol=2e-4)  # measured 2.7e-5
    llm.engine.check_idle()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernels_follow_the_torch_path_at_real_shapes(dtype, monkeypatch):
    """Both paths on CUDA. float32: cuDNN's conv without TF32, so that both are float32 sums.
    bfloat16: the two round the conv's sums (in another order) to bfloat16, and o."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    _check_steps("cuda", dtype, REAL)


@pytest.mark.gpu
@torch.inference_mode()
def test_a_decode_step_replays_in_a_cuda_graph():
    """The whole layer (projections, conv and delta-rule kernels, gated norm) on a decode step of
    6 sequences padded to 8, captured on one set of slots and replayed on another, gives the
    eager step's output and states bit for bit; the padded rows (slot -1) write no slot."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    layer = _layer("cuda", torch.bfloat16, **REAL)
    x = torch.randn(8, layer.in_proj_ba.weight.shape[1], device="cuda", dtype=torch.bfloat16)
    meta = _meta([1] * 8, [0, 2, 3, 5, 6, 7, -1, -1], "cuda")
    meta.state_slots_cpu = None  # the CUDA path reads no host slot
    slots = torch.tensor([6, 2, 7, 0, 3, 5, -1, -1], device="cuda")
    start = layer.conv_state.clone(), layer.recurrent_state.clone()
    assert_graph_replays(lambda: layer(x, meta), [x, meta.state_slots], [torch.randn_like(x), slots],
                         [layer.conv_state, layer.recurrent_state])
    for state, before in zip((layer.conv_state, layer.recurrent_state), start):  # slots no sequence held
        assert torch.equal(state[[1, 4]], before[[1, 4]])


@pytest.mark.gpu
@torch.inference_mode()
def test_a_mixed_step_waits_for_nothing():
    """A mixed step's layer (conv, decode rows, chunked prefills) queues its work without one
    host sync, its chunk layout built and copied from pinned memory included."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    layer = _layer("cuda", torch.bfloat16, **REAL)
    lens, slots = [1, 300, 1, 17], [3, 0, 6, 2]
    qkv, a, b = _inputs(layer, sum(lens), seed=1)
    layer._kernels(qkv, a, b, _meta(lens, slots, "cuda"))  # builds the kernels first
    meta = _meta(lens, slots, "cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        layer._kernels(qkv, a, b, meta)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from ember.kernels.causal_conv import _causal_conv_kernel
from ember.kernels.delta_rule_chunk import NUM_STAGES, _delta_rule_chunk_kernel
from ember.kernels.delta_rule_decode import _delta_rule_decode_kernel

# Qwen3-Next-80B-A3B in bfloat16; the conv of a decode step (one token a program) and a prefill's
CASES = [
    (_causal_conv_kernel, {"starts_ptr": "*i32", "slots_ptr": "*i64"}, "*bf16",
     dict(C=8192, K=4, BLOCK_T=1, BLOCK_C=128, BLOCK_K=4), 4),
    (_causal_conv_kernel, {"starts_ptr": "*i32", "slots_ptr": "*i64"}, "*bf16",
     dict(C=8192, K=4, BLOCK_T=32, BLOCK_C=128, BLOCK_K=4), 4),
    (_delta_rule_decode_kernel, {"state_ptr": "*fp32", "starts_ptr": "*i32", "slots_ptr": "*i64", "scale": "fp32",
                                 "eps": "fp32"}, "*bf16",
     dict(GROUP=2, KEY_DIM=2048, DK=128, DV=128, BLOCK_K=128, BLOCK_V=32), 4),
    (_delta_rule_chunk_kernel, {"chunk_starts_ptr": "*i32", "slots_ptr": "*i64"}, "*fp32",
     dict(H=32, DK=128, DV=128, BT=64, BLOCK_K=128, BLOCK_V=32), 8),
]
H100_SHARED = 232448  # bytes of shared memory a program may take on the H100 (sm_90)
for kernel, types, pointer, constants, warps in CASES:
    names = list(kernel.arg_names)
    signature = {n: "constexpr" if n in constants else types.get(n, pointer if n.endswith("_ptr") else "i32")
                 for n in names}
    source = ASTSource(kernel, signature, {(names.index(k),): v for k, v in constants.items()})
    stages = NUM_STAGES if kernel is _delta_rule_chunk_kernel else 3
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps,
                                                                               "num_stages": stages})
    assert "st.local" not in compiled.asm["ptx"], f"{kernel.fn.__name__} spills registers to local memory"
    assert compiled.metadata.shared <= H100_SHARED, f"{kernel.fn.__name__}: {compiled.metadata.shared} bytes of shared"
print("compiled")
"""


@pytest.mark.slow
def test_the_kernels_compile_for_hopper():
    """Triton compiles the three kernels at Qwen3-Next-80B-A3B's shapes to sm_90 PTX here, without
    a GPU, with the warps their wrappers launch, and none spills registers (Triton 3.6)."""
    assert "compiled" in run_compile_script(_COMPILE)
