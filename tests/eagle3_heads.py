"""EAGLE-3 heads for the tests beside ember.bench.dummy_eagle3's random ones (a head whose drafts
are right where the target repeats itself; the speculators library's layout), and a plain-torch
EAGLE-3 forward that drafts from transformers' hidden states of the target: the reference the
engine's drafts are held to."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

TINY_AUX = [1, 4, 6]  # write_tiny_drafters' head reads these of its target's 8 layers


def write_tiny_drafters(root: Path) -> None:
    """A random Llama of 64 tokens and 8 layers whose next-token distributions are peaked (weights
    of std 0.3), saved by transformers in root/target, and its drafters: its own first 2 layers
    with its embeddings, final norm and head (an early exit, root/early_exit), and a random
    EAGLE-3 head over half of its vocabulary reading TINY_AUX (root/eagle3)."""
    import transformers

    from ember.bench.dummy_eagle3 import head_config, random_head, save_head

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                                      tie_word_embeddings=False, initializer_range=0.3)
    target = transformers.LlamaForCausalLM(config)
    target.save_pretrained(root / "target")
    early = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config.to_dict() | {"num_hidden_layers": 2}))
    early.load_state_dict({k: v for k, v in target.state_dict().items()
                           if not k.startswith("model.layers.") or int(k.split(".")[2]) < 2})
    early.save_pretrained(root / "early_exit")
    head = head_config(64, 64, 32, TINY_AUX)
    save_head(root / "eagle3", head, random_head(head, seed=1, embed=True))


def mode_head(config: dict) -> dict[str, torch.Tensor]:
    """A head that drafts the most frequent of the tokens it has read (ties: the higher id), again
    and again: one-hot embeddings averaged by a uniform attention (queries zero), the target's
    features dropped (fc zero). Right wherever the target repeats one token."""
    h, vocab = config["hidden_size"], config["vocab_size"]
    assert vocab == h == config["num_key_value_heads"] * h // config["num_attention_heads"]
    eye = torch.eye(h)
    zero = torch.zeros
    return {"embed_tokens.weight": eye.clone(), "midlayer.input_layernorm.weight": torch.ones(h),
            "midlayer.hidden_norm.weight": torch.ones(h), "midlayer.self_attn.q_proj.weight": zero(h, 2 * h),
            "midlayer.self_attn.k_proj.weight": zero(h, 2 * h),
            "midlayer.self_attn.v_proj.weight": torch.cat([eye, zero(h, h)], dim=1),
            "midlayer.self_attn.o_proj.weight": eye.clone(), "midlayer.post_attention_layernorm.weight": torch.ones(h),
            "midlayer.mlp.gate_proj.weight": zero(config["intermediate_size"], h),
            "midlayer.mlp.up_proj.weight": zero(config["intermediate_size"], h),
            "midlayer.mlp.down_proj.weight": zero(h, config["intermediate_size"]),
            "fc.weight": zero(h, 3 * h), "norm.weight": torch.ones(h),
            "lm_head.weight": torch.diag(1 + 1e-3 * torch.arange(vocab, dtype=torch.float32)),
            "d2t": torch.zeros(vocab, dtype=torch.int64)}


def speculators_layout(config: dict, tensors: dict[str, torch.Tensor]) -> tuple[dict, dict[str, torch.Tensor]]:
    """The same head as the `speculators` library saves it (`Eagle3Speculator`: the layer's config
    nested, `layers.0.*`), with norm_before_residual on."""
    layer = {k: v for k, v in config.items() if k not in ("architectures", "draft_vocab_size", "target_hidden_size",
                                                          "eagle_config")}
    outer = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
             "transformer_layer_config": layer, "draft_vocab_size": config["draft_vocab_size"],
             "target_hidden_size": config["target_hidden_size"], "norm_before_residual": True,
             "eagle_aux_hidden_state_layer_ids": config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]}
    return outer, {k.replace("midlayer.", "layers.0."): v for k, v in tensors.items()}


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Llama's RoPE (halves rotated) on [T, heads, d]."""
    d = x.shape[-1]
    freqs = positions[:, None].double() / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    cos, sin = torch.cat([freqs.cos()] * 2, -1)[:, None].float(), torch.cat([freqs.sin()] * 2, -1)[:, None].float()
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def head_rows(config: dict, t: dict[str, torch.Tensor], embed: torch.Tensor, tokens: list[int],
              features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The head over rows 0 .. T-1 (row p: token tokens[p], feature features[p], position p),
    causal: (logits over the draft vocabulary, the stream before the final norm) of every row."""
    h, heads, kv = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    d, eps, n = h // heads, config["rms_norm_eps"], len(tokens)
    e = _rms(embed[torch.tensor(tokens)], t["midlayer.input_layernorm.weight"], eps)
    h_normed = _rms(features, t["midlayer.hidden_norm.weight"], eps)
    x = torch.cat([e, h_normed], -1)
    positions = torch.arange(n)
    q = _rotate((x @ t["midlayer.self_attn.q_proj.weight"].T).view(n, heads, d), positions, config["rope_theta"])
    k = _rotate((x @ t["midlayer.self_attn.k_proj.weight"].T).view(n, kv, d), positions, config["rope_theta"])
    v = (x @ t["midlayer.self_attn.v_proj.weight"].T).view(n, kv, d)
    k, v = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
    r = h_normed if config.get("norm_before_residual") else features
    r = r + o.transpose(0, 1).reshape(n, h) @ t["midlayer.self_attn.o_proj.weight"].T
    m = _rms(r, t["midlayer.post_attention_layernorm.weight"], eps)
    m = F.silu(m @ t["midlayer.mlp.gate_proj.weight"].T) * (m @ t["midlayer.mlp.up_proj.weight"].T)
    r = r + m @ t["midlayer.mlp.down_proj.weight"].T
    return _rms(r, t["norm.weight"], eps) @ t["lm_head.weight"].T, r


@torch.no_grad()
def reference_drafts(hf_target, config: dict, t: dict[str, torch.Tensor], aux_layers: list[int],
                     token_ids: list[int], k: int) -> list[int]:
    """The k greedy drafts after `token_ids` (whose last token the target has not read yet):
    rows 0 .. n-2 from the target's hidden states entering `aux_layers`, then one row a draft on
    the head's own stream."""
    embed = t["embed_tokens.weight"] if "embed_tokens.weight" in t else hf_target.model.embed_tokens.weight
    states = hf_target(torch.tensor([token_ids[:-1]]), output_hidden_states=True).hidden_states
    features = torch.cat([states[i][0] for i in aux_layers], -1) @ t["fc.weight"].T
    tokens, drafts = list(token_ids[1:]), []
    for _ in range(k):
        logits, stream = head_rows(config, t, embed, tokens, features)
        best = int(logits[-1].argmax())
        drafts.append(best + int(t["d2t"][best]))
        tokens.append(drafts[-1])
        features = torch.cat([features, stream[-1:]])
    return drafts
