"""The small Llama shape the CUDA engine tests of weight formats run at (test_cuda_fp8.py,
test_cuda_int_weights.py, test_cuda_w8a8.py): hidden 1024, 8 heads of 128, 4 KV heads,
intermediate 3072, 6 layers; the engine's limits for them, their prompts, and the dense
checkpoint the integer formats are packed from."""

from __future__ import annotations

import json
from pathlib import Path

import torch

CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 8192, "hidden_size": 1024,
    "intermediate_size": 3072, "num_hidden_layers": 6, "num_attention_heads": 8, "num_key_value_heads": 4,
    "head_dim": 128, "rms_norm_eps": 1e-5, "max_position_embeddings": 4096, "rope_theta": 500000.0,
    "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
}
ARGS = {"max_model_len": 1024, "max_num_seqs": 16, "num_kv_blocks": 256}
# the linear layers' weights: q|k|v, o, gate|up|down in each of the 6 layers
LINEAR_WEIGHTS = 6 * (1024 * (1024 + 2 * 512) + 1024 * 1024 + 3 * 1024 * 3072)


def write_dense_checkpoint(path: Path) -> Path:
    """CONFIG with random weights (seed 11) as config.json + model.safetensors in `path`."""
    from safetensors.torch import save_file

    from ember.loader.dummy import iter_dummy_weights
    from ember.models.config import ModelConfig

    weights = {n: t.contiguous() for n, t in iter_dummy_weights(ModelConfig.from_hf_config(CONFIG), seed=11)}
    (path / "config.json").write_text(json.dumps(CONFIG))
    save_file(weights, str(path / "model.safetensors"))
    return path


def random_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """n random prompts (n <= 8) of 1 to 300 tokens."""
    g = torch.Generator().manual_seed(seed)
    lengths = [3, 17, 64, 129, 300, 1, 45, 250][:n]
    return [torch.randint(3, CONFIG["vocab_size"], (n_,), generator=g).tolist() for n_ in lengths]
