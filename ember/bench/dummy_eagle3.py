"""An EAGLE-3 head of random weights for a target's shapes, in the layout vLLM and SGLang load
(`LlamaForCausalLMEagle3`: `midlayer.*`, `fc`, `lm_head`, `d2t` / `t2d` in one safetensors file),
for benchmarks where no trained head is at hand: its drafts are noise (about none accepted), so a
run measures what drafting and verifying cost.

    python -m ember.bench.dummy_eagle3 benchmarks/configs/llama-3.1-8b/config.json /tmp/eagle3-head
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def head_config(hidden: int, vocab: int, draft_vocab: int, aux_layers: list[int] | None, heads: int = 4,
                kv_heads: int = 2, intermediate: int = 128, target_hidden: int | None = None,
                head_dim: int | None = None) -> dict:
    """config.json of a one-layer head; `aux_layers` None: the target's default layers."""
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": hidden,
              "num_attention_heads": heads, "num_key_value_heads": kv_heads, "intermediate_size": intermediate,
              "num_hidden_layers": 1, "vocab_size": vocab, "draft_vocab_size": draft_vocab, "rms_norm_eps": 1e-6,
              "rope_theta": 10000.0, "max_position_embeddings": 4096, "hidden_act": "silu",
              "tie_word_embeddings": False, "target_hidden_size": target_hidden or hidden}
    if head_dim is not None:
        config["head_dim"] = head_dim
    if aux_layers is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_layers}
    return config


def random_head(config: dict, seed: int, embed: bool, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Random weights (`embed`: an embedding of its own, else it embeds with the target's); the
    draft vocabulary every (vocab // draft_vocab)-th target id, through d2t's offsets."""
    g = torch.Generator().manual_seed(seed)
    h, heads, kv = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    d = config.get("head_dim") or h // heads
    inter, vocab, dv = config["intermediate_size"], config["vocab_size"], config["draft_vocab_size"]

    def w(*shape: int, scale: float = 0.1) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    ids = torch.arange(dv) * (vocab // dv)
    t = {"midlayer.input_layernorm.weight": 1 + w(h), "midlayer.hidden_norm.weight": 1 + w(h),
         "midlayer.self_attn.q_proj.weight": w(heads * d, 2 * h), "midlayer.self_attn.k_proj.weight": w(kv * d, 2 * h),
         "midlayer.self_attn.v_proj.weight": w(kv * d, 2 * h), "midlayer.self_attn.o_proj.weight": w(h, heads * d),
         "midlayer.post_attention_layernorm.weight": 1 + w(h), "midlayer.mlp.gate_proj.weight": w(inter, h),
         "midlayer.mlp.up_proj.weight": w(inter, h), "midlayer.mlp.down_proj.weight": w(h, inter),
         "fc.weight": w(h, 3 * config["target_hidden_size"], scale=0.05), "norm.weight": 1 + w(h),
         "lm_head.weight": w(dv, h, scale=1.0), "d2t": ids - torch.arange(dv),
         "t2d": torch.zeros(vocab, dtype=torch.bool).index_fill(0, ids, True)}
    if embed:
        t["embed_tokens.weight"] = w(vocab, h, scale=1.0)
    return t


def save_head(path: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    return path


def write_head_for(target_config: dict, path: Path, draft_vocab: int = 32000, seed: int = 0,
                   aux_layers: list[int] | None = None) -> Path:
    """A bf16 head at a target's shapes (its config.json as a dict): the target's hidden size,
    heads and intermediate size, its embeddings shared; `aux_layers` None: no layer ids in its
    config (each engine takes the target's default)."""
    heads = target_config["num_attention_heads"]
    config = head_config(target_config["hidden_size"], target_config["vocab_size"],
                         min(draft_vocab, target_config["vocab_size"]), aux_layers, heads=heads,
                         kv_heads=target_config.get("num_key_value_heads", heads),
                         intermediate=target_config["intermediate_size"],
                         head_dim=target_config.get("head_dim"))
    return save_head(path, config, random_head(config, seed, embed=False, dtype=torch.bfloat16))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("target_config", help="the target's config.json")
    ap.add_argument("out", help="the head's directory")
    ap.add_argument("--draft-vocab", type=int, default=32000)
    args = ap.parse_args()
    print(write_head_for(json.loads(Path(args.target_config).read_text()), Path(args.out), args.draft_vocab))


if __name__ == "__main__":
    main()
