"""DeepSeek-V2 / V3 (and Kimi-K2, V3's architecture): multi-head latent attention over a
cache of one latent a token (models/mla.py) and DeepSeekMoE's routers, on tiny random models
whose checkpoints carry DeepSeek's own tensor names (shared_experts, per-expert projections,
V3's e_score_correction_bias): ember's logits and greedy tokens equal transformers'
(float32), through chunked prefill and a prefix-cache hit too.

Three variants, the real configs' options scaled down:
- V2-Lite: queries projected directly (no q_lora_rank), softmax routing greedy over all
  experts, two shared experts, a dense first layer;
- V2: q_lora_rank, group_limited_greedy (each group scored by its best expert), weights
  times routed_scaling_factor;
- V3: q_lora_rank, sigmoid scores with the correction bias choosing by the sum of each
  group's best two, top-k renormalized then scaled, YaRN with mscale_all_dim (the attention
  scale times mscale squared), and a multi-token-prediction layer in the file that is not read.
"""

from __future__ import annotations

import json

import pytest
import torch
from family_checks import (
    ENGINE,
    MAX_TOKENS,
    PROMPTS,
    assert_chunked_and_cached,
    assert_logits_match,
    greedy_tokens,
    hf_greedy,
)
from llama_cpp_tools import assert_greedy_agrees

from ember import LLM, SamplingParams
from ember.loader.dummy import iter_dummy_weights
from ember.models.config import ModelConfig

transformers = pytest.importorskip("transformers")
from safetensors.torch import save_file  # noqa: E402

pytestmark = pytest.mark.slow

BASE = {
    "vocab_size": 320, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3, "num_attention_heads": 4,
    "max_position_embeddings": 512, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "rms_norm_eps": 1e-6,
    "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 12, "moe_intermediate_size": 24,
    "n_shared_experts": 2, "num_experts_per_tok": 3, "first_k_dense_replace": 1, "tie_word_embeddings": False,
    "rope_theta": 10000.0,
}
V2 = BASE | {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2"}
V3 = BASE | {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3"}
VARIANTS = {
    "v2_lite": V2 | {"q_lora_rank": None, "n_routed_experts": 8, "topk_method": "greedy", "n_group": 1,
                     "topk_group": 1, "routed_scaling_factor": 1.0},
    "v2": V2 | {"q_lora_rank": 24, "n_routed_experts": 16, "topk_method": "group_limited_greedy", "n_group": 4,
                "topk_group": 2, "routed_scaling_factor": 2.5},
    "v3": V3 | {"q_lora_rank": 24, "n_routed_experts": 16, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5,
                "norm_topk_prob": True, "num_nextn_predict_layers": 1, "scoring_func": "sigmoid",
                "topk_method": "noaux_tc",
                "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "mscale": 1.0,
                                 "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}},
}


def save_deepseek(config: dict, path, mtp_layer: bool = False) -> ModelConfig:
    """config.json and seeded random weights under DeepSeek's names (ember's dummy draws, the
    shared experts renamed back); with `mtp_layer`, a multi-token-prediction layer after the
    model's (as DeepSeek-V3's files hold layer 61)."""
    (path / "config.json").write_text(json.dumps(config))
    cfg = ModelConfig.from_hf_config(config)
    weights = {n.replace(".mlp.shared_expert.", ".mlp.shared_experts."): t.contiguous()
               for n, t in iter_dummy_weights(cfg, seed=7)}
    if mtp_layer:
        last = f"model.layers.{cfg.num_layers - 1}."
        weights |= {n.replace(last, f"model.layers.{cfg.num_layers}."): t.clone() for n, t in weights.items()
                    if n.startswith(last)} | {f"model.layers.{cfg.num_layers}.eh_proj.weight": torch.zeros(64, 128)}
    save_file(weights, str(path / "model.safetensors"))
    return cfg


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    cfg = save_deepseek(VARIANTS[request.param], path, mtp_layer=request.param == "v3")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return request.param, cfg, path, hf, LLM(str(path), **ENGINE), [hf_greedy(hf, ids) for ids in PROMPTS]


def test_logits_match_hf(variant, forward_logits):
    _, _, _, hf, llm, _ = variant
    assert_logits_match(llm, hf, PROMPTS, forward_logits)


def test_greedy_matches_hf(variant):
    *_, llm, expected = variant
    assert greedy_tokens(llm) == expected


def test_chunked_prefill_and_prefix_hit_match_hf(variant):
    """Chunks of prefill over the cached latents, then whole prompts' blocks from the cache."""
    _, _, path, _, _, expected = variant
    assert_chunked_and_cached(str(path), expected)


def test_the_cache_holds_one_latent_a_token(variant):
    """Bytes a token in the KV pool: layers x (kv_lora_rank + qk_rope_head_dim) x 4 (float32),
    one plane; keys and values per head would take 2 x heads x (nope + rope) a layer (and
    transformers' own cache keeps the latent and the RoPE key apart, as ember's one entry does)."""
    _, cfg, _, _, llm, _ = variant
    runner = llm.engine.runner
    per_token = runner.kv_bytes_per_block() // llm.config.block_size
    assert per_token == 3 * (32 + 8) * 4
    assert tuple(runner.kv_cache.shape) == (1, 3, runner.num_blocks, 8, 1, 40)
    assert 3 * 2 * 4 * (16 + 8) * 4 / per_token == pytest.approx(4.8)  # what expanded heads would cost here
    attn = runner.model.attention_layers()[0]
    assert attn.k_cache.data_ptr() == attn.v_cache.data_ptr()


def test_config_reads_the_routing_and_the_latent():
    v3 = ModelConfig.from_hf_config(VARIANTS["v3"])
    assert (v3.architecture, v3.kv_lora_rank, v3.q_lora_rank, v3.head_dim, v3.rotary_dim, v3.v_head_dim) == \
        ("deepseek_v3", 32, 24, 24, 8, 12)
    assert (v3.moe_scoring, v3.moe_groups, v3.moe_topk_groups, v3.routed_scaling_factor, v3.norm_topk_prob) == \
        ("sigmoid", 4, 2, 2.5, True)
    assert v3.moe_layers == (False, True, True) and v3.shared_expert_intermediate_size == 48
    assert not v3.shared_expert_gate and v3.rope_interleaved
    mscale = 0.1 * torch.log(torch.tensor(4.0)).item() + 1.0
    assert v3.attention_scale == pytest.approx(24 ** -0.5 * mscale * mscale)
    lite = ModelConfig.from_hf_config(VARIANTS["v2_lite"])
    assert (lite.moe_scoring, lite.moe_groups, lite.q_lora_rank, lite.norm_topk_prob) == ("softmax", 1, 0, False)
    assert lite.attention_scale == pytest.approx(24 ** -0.5)
    kimi = ModelConfig.from_hf_config({k: v for k, v in VARIANTS["v3"].items() if k != "architectures"}
                                      | {"model_type": "kimi_k2"})
    assert kimi.architecture == "deepseek_v3"


def test_rope_not_interleaved(tmp_path, forward_logits):
    """A V3 checkpoint with rope_interleave false: its RoPE rows are already rotate-half."""
    config = VARIANTS["v3"] | {"rope_interleave": False}
    save_deepseek(config, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    llm = LLM(str(tmp_path), **ENGINE)
    assert not llm.engine.runner.model.config.rope_interleaved
    assert_logits_match(llm, hf, PROMPTS, forward_logits)


@pytest.mark.parametrize("change,says", [
    ({"topk_method": "noaux_tc", "scoring_func": "softmax"}, "noaux_tc with sigmoid"),
    ({"topk_method": "group_limited_greedy", "scoring_func": "sigmoid"}, "noaux_tc with sigmoid"),
    ({"topk_method": "some_new_method"}, "'some_new_method' .* not supported"),
])
def test_routing_ember_does_not_run_is_refused(change, says):
    with pytest.raises(ValueError, match=says):
        ModelConfig.from_hf_config(VARIANTS["v2"] | change)


# DeepSeek as llama.cpp users get it: converted by llama.cpp's own convert_hf_to_gguf.py (its
# deepseek2 architecture: MLA written as multi-query attention, kv_b_proj split per head into
# attn_k_b / attn_v_b, the experts stacked), with SmolLM2's BPE tokenizer (one the converter
# recognises), as real configs state num_key_value_heads
GGUF_VARIANTS = ("v2_lite", "v3")
GGUF_ENGINE = ENGINE | dict(num_kv_blocks=32, kv_cache_dtype="float32")  # a GGUF's default cache is float16


@pytest.fixture(scope="module", params=GGUF_VARIANTS)
def converted(request, tmp_path_factory, gguf_convert, bpe_tokenizer_dir):
    import shutil

    name = request.param
    root = tmp_path_factory.mktemp(f"{name}-gguf")
    save_deepseek(VARIANTS[name] | {"vocab_size": 49152, "num_key_value_heads": 4}, root)
    for f in bpe_tokenizer_dir.iterdir():
        shutil.copy(f, root / f.name)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(root), dtype=torch.float32).eval()
    return name, root, gguf_convert(root, "f32"), hf


def test_the_gguf_config_is_the_hf_one(converted):
    from ember.loader.gguf import open_gguf

    _, root, path, _ = converted
    f = open_gguf(path)
    assert f.architecture == "deepseek2" and "blk.0.attn_k_b.weight" in f.tensor_names
    ours, theirs = ModelConfig.from_gguf_metadata(f.metadata, f.tensor_names), ModelConfig.from_hf_dir(root)
    different = {k for k in theirs.__dataclass_fields__ if getattr(ours, k) != getattr(theirs, k)}
    # eps written as float32; YaRN as llama.cpp runs DeepSeek's (cos and sin unscaled, mscale
    # on the scores): the same numbers as transformers' mscale / mscale_all_dim of 1.0
    assert different <= {"rms_norm_eps", "rope_scaling", "attention_scale_factor", "architecture"}
    assert ours.attention_scale == pytest.approx(theirs.attention_scale)


def test_gguf_logits_and_greedy_match_transformers(converted, forward_logits):
    _, root, path, hf = converted
    llm = LLM(str(path), **GGUF_ENGINE)
    assert_logits_match(llm, hf, PROMPTS, forward_logits)
    assert greedy_tokens(llm) == [hf_greedy(hf, ids) for ids in PROMPTS]


def test_gguf_greedy_matches_llama_cpp(converted, llama_greedy):
    """llama.cpp's own greedy tokens on the same file (where its llama-server is built), up to a
    near-tie of a random model's logits."""
    name, _, path, _ = converted
    if name == "v2_lite":  # its converter writes no q_lora_rank for a model without one, which its loader needs
        pytest.skip("llama.cpp 0.3.36 does not load a DeepSeek-V2-Lite GGUF (\"key not found in model: "
                    "deepseek2.attention.q_lora_rank\")")
    llm = LLM(str(path), **GGUF_ENGINE)
    ours = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=5))
    theirs = llama_greedy(path, PROMPTS, MAX_TOKENS, ctx=GGUF_ENGINE["max_model_len"])
    assert_greedy_agrees(ours, theirs.tokens)


def test_q8_0_gguf_keeps_its_blocks(converted, gguf_convert):
    """A Q8_0 file on the CPU's default path: the 2-D projections stay in their blocks (the
    RoPE rows reordered a whole row at a time), kv_b_proj is rebuilt from k_b / v_b dense,
    and the greedy tokens follow float32's for most of the way (int8 activations)."""
    from ember.layers.quant.gguf_blocks import GGUFBlocks

    name, root, _, hf = converted
    llm = LLM(str(gguf_convert(root, "q8_0")), **ENGINE)
    attn = llm.engine.runner.model.attention_layers()[1]
    assert isinstance(attn.kv_a_proj_with_mqa.format, GGUFBlocks) and attn.kv_b_proj.weight.is_floating_point()
    out = llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert out[0].outputs[0].token_ids[:4] == hf_greedy(hf, PROMPTS[0])[:4]


# The non-absorbed prefill (models/mla.py): on CUDA by default, forced on here on the CPU. Each
# forward's split is recorded (the real function, called through) so a test knows it ran.
@pytest.fixture
def expanded(monkeypatch, mla_expanded_plans):
    from ember.models import mla

    monkeypatch.setattr(mla.LatentAttention, "expanded_prefill", True)
    return mla_expanded_plans


def test_expanded_prefill_matches_hf(variant, forward_logits, expanded):
    _, _, path, hf, _, expected = variant
    llm = LLM(str(path), **ENGINE)
    assert_logits_match(llm, hf, PROMPTS, forward_logits)
    assert len(expanded) == 1  # every row expanded, in one group
    assert [g.prefill.query_lens_cpu for g in expanded[0].groups] == [[13, 1, 27]]
    assert greedy_tokens(llm) == expected
    assert all(p is not None for p in expanded)


def test_expanded_prefill_chunked_cached_and_mixed(variant, expanded):
    """5-token chunks: the later prompts' chunks share steps with the first's decode rows
    (absorbed) and read their earlier chunks, then whole prompts' blocks, from the cache."""
    _, _, path, _, _, expected = variant
    assert_chunked_and_cached(str(path), expected)
    assert any(p.decode_tokens and p.groups for p in expanded)  # a mixed step
    cached = [p for p in expanded for g in p.groups
              if any(s > q for s, q in zip(g.prefill.seq_lens_cpu, g.prefill.query_lens_cpu))]
    assert cached  # a chunk over a context before it


def test_expanded_prefill_in_groups_under_its_limit(variant, forward_logits, expanded, monkeypatch):
    """Contexts of 2 + 1 + 4 blocks of 8 under a limit of 4 blocks: two groups, one call each."""
    from ember.models import mla

    _, _, path, hf, _, expected = variant
    monkeypatch.setattr(mla.LatentAttention, "expanded_limit", 32)
    llm = LLM(str(path), **ENGINE)
    assert_logits_match(llm, hf, PROMPTS, forward_logits)
    assert [[g.prefill.query_lens_cpu for g in p.groups] for p in expanded] == [[[13, 1], [27]]]
    assert [(g.tokens.start, g.tokens.stop, g.slots.numel()) for g in expanded[0].groups] == [(0, 14, 24), (14, 41, 32)]
    assert greedy_tokens(llm) == expected


def test_expanded_prefill_past_its_limit_stays_absorbed(variant, expanded, monkeypatch):
    from ember.models import mla

    _, _, path, _, _, expected = variant
    monkeypatch.setattr(mla.LatentAttention, "expanded_limit", 16)  # two 8-token blocks
    llm = LLM(str(path), **(ENGINE | dict(max_num_batched_tokens=5)))
    assert greedy_tokens(llm) == expected
    assert None in expanded and any(p is not None for p in expanded)
