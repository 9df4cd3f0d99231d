"""Mixtures of experts: Mixtral, Qwen3-MoE (one dense layer among the sparse ones) and Qwen2-MoE
(a shared expert, q/k/v bias) on tiny
random models saved by HF transformers give transformers' logits and greedy tokens (float32);
the FusedMoE layer equals a plain per-token loop over each token's experts."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from family_checks import MAX_TOKENS, PROMPTS, assert_logits_match, hf_greedy
from test_families import BASE, build

from ember import SamplingParams
from ember.layers.moe import FusedMoE
from ember.loader.dummy import iter_dummy_weights
from ember.loader.model_files import load_model, locate_model
from ember.loader.weights import load_weights
from ember.models.config import ModelConfig

MOE = {
    "mixtral": BASE | {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "rope_theta": 10000.0,
                       "num_local_experts": 8, "num_experts_per_tok": 2, "tie_word_embeddings": False},
    # layer 1 dense by mlp_only_layers; experts narrower than the dense MLP; 6 of 16 experts per token
    "qwen3_moe": BASE | {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "head_dim": 16,
                         "rope_theta": 10000.0, "num_experts": 16, "num_experts_per_tok": 6,
                         "moe_intermediate_size": 32, "norm_topk_prob": True, "decoder_sparse_step": 1,
                         "mlp_only_layers": [1], "tie_word_embeddings": False},
    # the top-k weights as the softmax gives them (not renormalized); every other layer dense
    "qwen3_moe_unnormalized": BASE | {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                                      "rope_theta": 10000.0, "num_experts": 8, "num_experts_per_tok": 2,
                                      "moe_intermediate_size": 48, "norm_topk_prob": False,
                                      "decoder_sparse_step": 2, "tie_word_embeddings": True},
    "qwen2_moe": BASE | {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "rope_theta": 10000.0,
                         "num_experts": 8, "num_experts_per_tok": 3, "moe_intermediate_size": 32,
                         "shared_expert_intermediate_size": 80, "norm_topk_prob": False, "mlp_only_layers": [2],
                         "tie_word_embeddings": False},
}


@pytest.fixture(scope="module", params=sorted(MOE))
def moe_model(request, tmp_path_factory):
    pytest.importorskip("transformers")
    cfg, hf, llm = build(request.param, MOE[request.param], tmp_path_factory)
    return request.param, cfg, hf, llm


@pytest.mark.slow
def test_moe_logits_match_hf(moe_model, forward_logits):
    _, _, hf, llm = moe_model
    assert_logits_match(llm, hf, PROMPTS, forward_logits)


def assert_greedy_matches_hf(llm, hf) -> None:
    expected = [hf_greedy(hf, ids, MAX_TOKENS) for ids in PROMPTS]
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == expected


@pytest.mark.slow
def test_moe_greedy_matches_hf(moe_model):
    _, _, hf, llm = moe_model
    assert_greedy_matches_hf(llm, hf)


def test_moe_config_reads_the_options():
    mixtral = ModelConfig.from_hf_config(MOE["mixtral"])
    assert (mixtral.moe_layers, mixtral.num_experts, mixtral.num_experts_per_tok, mixtral.moe_intermediate_size,
            mixtral.norm_topk_prob, mixtral.qk_norm) == ((True,) * 4, 8, 2, 96, True, False)
    qwen = ModelConfig.from_hf_config(MOE["qwen3_moe"])
    assert (qwen.moe_layers, qwen.num_experts, qwen.num_experts_per_tok, qwen.moe_intermediate_size,
            qwen.intermediate_size, qwen.norm_topk_prob, qwen.qk_norm) == \
        ((True, False, True, True), 16, 6, 32, 96, True, True)
    # transformers 5.25's Qwen3MoeConfig saves its expert count as num_local_experts
    renamed = {k: v for k, v in MOE["qwen3_moe"].items() if k != "num_experts"} | {"num_local_experts": 16}
    assert ModelConfig.from_hf_config(renamed) == qwen
    every_other = ModelConfig.from_hf_config(MOE["qwen3_moe_unnormalized"])
    assert (every_other.moe_layers, every_other.norm_topk_prob) == ((False, True, False, True), False)
    qwen2 = ModelConfig.from_hf_config(MOE["qwen2_moe"])
    assert (qwen2.moe_layers, qwen2.shared_expert_intermediate_size, qwen2.attention_bias, qwen2.qk_norm) == \
        ((True, True, False, True), 80, True, False)
    with pytest.raises(ValueError, match=r"num_experts_per_tok 9 must be within 1..num_experts \(8\)"):
        ModelConfig.from_hf_config(MOE["mixtral"] | {"num_experts_per_tok": 9})


def _dummy_model(path, config: dict, seed: int = 0):
    (path / "config.json").write_text(json.dumps(config))
    return load_model(locate_model(str(path), "dummy"), ModelConfig.from_hf_config(config), max_positions=128,
                      dtype=torch.float32, device="cpu", attention_backend="torch", seed=seed)


def test_dummy_weights_fill_the_stacked_expert_weights(tmp_path):
    """Dummy weights, drawn per expert under the checkpoint's names, land in [E, 2I, H] and
    [E, H, I]; the shared expert's gate|up merged as a dense MLP's; layer 2 dense."""
    model = _dummy_model(tmp_path, MOE["qwen2_moe"])
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters() if ".mlp." in n}
    assert {n: s for n, s in shapes.items() if n.startswith("model.layers.0.")} == {
        "model.layers.0.mlp.gate.weight": (8, 64),
        "model.layers.0.mlp.w13": (8, 64, 64),
        "model.layers.0.mlp.w2": (8, 64, 32),
        "model.layers.0.mlp.shared_expert.gate_up_proj.weight": (160, 64),
        "model.layers.0.mlp.shared_expert.down_proj.weight": (64, 80),
        "model.layers.0.mlp.shared_expert_gate.weight": (1, 64),
    }
    assert {n: s for n, s in shapes.items() if n.startswith("model.layers.2.")} == {
        "model.layers.2.mlp.gate_up_proj.weight": (192, 64), "model.layers.2.mlp.down_proj.weight": (64, 96)}
    w13 = model.get_parameter("model.layers.0.mlp.w13")
    assert all(w13[e].std() > 0.01 for e in range(8))  # every expert drawn, none left empty


def test_a_missing_expert_is_named(tmp_path):
    model = _dummy_model(tmp_path, MOE["mixtral"])
    cfg = ModelConfig.from_hf_config(MOE["mixtral"])
    weights = ((n, t) for n, t in iter_dummy_weights(cfg) if n != "model.layers.3.block_sparse_moe.experts.5.w3.weight")
    with pytest.raises(ValueError, match=r"1 missing: model\.layers\.3\.mlp\.experts\.5\.up_proj\.weight$"):
        load_weights(model, weights, "test checkpoint")


def _per_token_reference(moe: FusedMoE, x: torch.Tensor) -> torch.Tensor:
    """Each token alone: softmax, top-k, (renormalize), and the sum of its experts' SwiGLU MLPs."""
    out = torch.zeros_like(x)
    inter = moe.intermediate_size
    for t in range(x.shape[0]):
        probs = torch.softmax(x[t] @ moe.gate.weight.t(), dim=-1)
        weights, ids = torch.topk(probs, moe.top_k)
        if moe.renormalize:
            weights = weights / weights.sum()
        for w, e in zip(weights.tolist(), ids.tolist()):
            gate, up = moe.w13[e, :inter] @ x[t], moe.w13[e, inter:] @ x[t]
            out[t] += w * (moe.w2[e] @ (F.silu(gate) * up))
    return out


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_fused_moe_equals_the_per_token_loop(renormalize, tokens):
    """16 experts, top 4: with 1 or 3 tokens most experts receive none."""
    gen = torch.Generator().manual_seed(tokens)
    moe = FusedMoE(hidden_size=32, intermediate_size=24, num_experts=16, top_k=4, renormalize=renormalize)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        x = torch.randn(tokens, 32, generator=gen)
        got = moe(x)
        want = _per_token_reference(moe, x)
    active = len(set(moe.route(moe.gate(x))[1].flatten().tolist()))
    assert active == 4 if tokens == 1 else active > 4
    torch.testing.assert_close(got, want)


def test_fused_moe_refuses_a_top_k_beyond_its_experts():
    with pytest.raises(ValueError, match=r"top_k 5 must be within 1..num_experts \(4\)"):
        FusedMoE(8, 8, num_experts=4, top_k=5, renormalize=True)


def test_fp8_for_moe_covers_the_linear_layers_and_says_the_experts_stay_dense(tmp_path, caplog):
    """On the CPU (no FP8 MoE kernel there), quantization='fp8' makes the attention (and any
    dense MLP) FP8 and keeps the stacked experts in the run dtype, and says so."""
    import logging

    from ember import LLM
    from ember.layers.quant.fp8 import FP8Weight

    (tmp_path / "config.json").write_text(json.dumps(MOE["mixtral"]))
    with caplog.at_level(logging.INFO):
        llm = LLM(str(tmp_path), load_format="dummy", device="cpu", quantization="fp8", dtype="float32",
                  num_kv_blocks=16, max_model_len=64)
    assert "mixtral: quantization='fp8' covers the linear layers; the experts' stacked weights stay in the run dtype " \
        "on the CPU" in caplog.text
    layer = llm.engine.runner.model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj.format, FP8Weight) and layer.mlp.w13.dtype == torch.float32
