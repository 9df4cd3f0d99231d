"""The tiny random Qwen3-Next the tests build (tests/models/test_qwen3_next.py,
tests/distributed/test_tensor_parallel*.py): ember's dummy weights saved as a checkpoint, with a
linear-attention layer's own scales."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ember.loader.dummy import iter_dummy_weights
from ember.models.config import ModelConfig

# three linear-attention layers, then a full one; 2 key heads of 16 dims serving 4 value heads of
# 24; RoPE on half of each 16-dim head; layer 1's MLP dense, the others 8 experts (2 a token)
# beside a gated shared expert
QWEN3_NEXT = {
    "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "vocab_size": 320, "hidden_size": 64,
    "intermediate_size": 96, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "rms_norm_eps": 1e-6, "max_position_embeddings": 512, "bos_token_id": 1, "eos_token_id": 2,
    "pad_token_id": 0, "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"], "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 16, "linear_value_head_dim": 24, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48,
    "decoder_sparse_step": 1, "mlp_only_layers": [1], "norm_topk_prob": True, "tie_word_embeddings": False,
}


def save_qwen3_next(config: dict, path: Path) -> None:
    """The dummy weights, with a linear layer's own scales where 0.02 * N(0, 1) would leave it
    idle: conv taps near 0.4, decays exp(-A * softplus(a + dt_bias)) over A in 1..16 and dt_bias
    near 1, as Qwen3NextGatedDeltaNet's initialization draws them; and a multi-token-prediction
    layer as Qwen's checkpoints carry it (mtp.*: the last layer's tensors, its projection of
    embedding | hidden state and three norms), which neither transformers nor ember reads."""
    from safetensors.torch import save_file

    (path / "config.json").write_text(json.dumps(config))
    gen = torch.Generator().manual_seed(3)
    last, h = f"model.layers.{config['num_hidden_layers'] - 1}.", config["hidden_size"]
    weights = {"mtp.fc.weight": 0.02 * torch.randn(h, 2 * h, generator=gen)}
    weights |= {f"mtp.{norm}.weight": 0.1 * torch.randn(h, generator=gen)
                for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}
    for name, t in iter_dummy_weights(ModelConfig.from_hf_config(config), seed=7):
        if name.endswith("conv1d.weight"):
            t = 20 * t
        elif name.endswith("A_log"):
            t = torch.empty(t.shape).uniform_(1, 16, generator=gen).log()
        elif name.endswith("dt_bias"):
            t = 1 + 20 * t
        weights[name] = t.contiguous()
        if name.startswith(last):
            weights["mtp.layers.0." + name.removeprefix(last)] = t.clone()
    save_file(weights, str(path / "model.safetensors"))


def save_for_llama_cpp(path: Path, tokenizer_dir: Path) -> None:
    """The tiny model with a tokenizer llama.cpp's converter recognises (SmolLM2's) and every MLP
    sparse: the converter maps no dense MLP in a qwen3next layer (nor do the real models have one)."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tokenizer.save_pretrained(str(path))
    save_qwen3_next(QWEN3_NEXT | {"vocab_size": len(tokenizer), "mlp_only_layers": []}, path)
