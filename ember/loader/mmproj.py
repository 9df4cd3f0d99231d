"""llama.cpp's mmproj GGUF files (`convert_hf_to_gguf.py --mmproj`; llama-server's `--mmproj`):
a vision tower and its projector, beside the text GGUF the same converter writes for the
language model. ember runs those of these projector types (clip.projector_type), from the
file's metadata:

    clip.vision.{embedding_length, feed_forward_length, block_count, attention.head_count,
    patch_size, image_size, attention.layer_norm_epsilon, image_mean, image_std},
    clip.use_gelu / clip.use_silu (the tower's MLP: GELU, SiLU, or llama.cpp's default quick GELU)

  "pixtral" (models/pixtral.py: pixtral-12b; Mistral-Small-3.1 with its patch merger and
      clip.vision.spatial_merge_size): image_size is the longest side; clip.cpp fixes RoPE theta
      10000 and the projector's RMSNorm at the tower's epsilon. Image token: the vocabulary's [IMG].
  "gemma3" (models/siglip.py, gemma3_vision.py): the image resized to image_size square, its patch
      grid average-pooled by clip.vision.projector.scale_factor (clip.cpp's 4 where it lacks).
      Image tokens: <start_of_image>, <image_soft_token> x tokens, <end_of_image>.
  "qwen2vl_merger", "qwen2.5vl_merger", "qwen3vl_merger" (models/qwen2_vl.py, qwen3_vl.py):
      patches merged clip.vision.spatial_merge_size a side (2 where it lacks), two frames a
      temporal patch; Qwen2.5-VL's windows of clip.vision.window_size pixels (clip.cpp's 112
      where it lacks) with full attention in every clip.vision.n_wa_pattern-th block; Qwen3-VL's
      learned positions on the image_size / patch_size grid and deepstack mergers after the blocks
      clip.vision.is_deepstack_layers flags. Image token: <|image_pad|>; the text GGUF is
      llama.cpp's qwen2vl / qwen3vl (M-RoPE).

A key ember does not honour, another projector type, a file without a vision encoder, a text
model the tower does not fit: refused by name. Tensors take ember's names (`_NAMES`), and what the
converter changed is undone: Pixtral's Q and K rows un-permuted (LlamaModel.permute), Gemma 3's
soft-embedding norm stored as 1 + w, Qwen2-VL's fused q|k|v split into three and its Conv3d patch
embedding into one Conv2d a frame (`.weight`, `.weight.1`)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ember.models.config import ModelConfig
from ember.models.vision_config import VisionConfig

# the metadata of an mmproj file ember reads (beside general.*), for every projector type and for
# each; a file that sets any other clip.* key is refused
_READ = {"clip.has_vision_encoder", "clip.projector_type", "clip.vision.projection_dim", "clip.vision.image_size",
         "clip.vision.patch_size", "clip.vision.embedding_length", "clip.vision.feed_forward_length",
         "clip.vision.block_count", "clip.vision.attention.head_count", "clip.vision.image_mean",
         "clip.vision.image_std", "clip.vision.attention.layer_norm_epsilon", "clip.use_gelu", "clip.use_silu"}
_READ_BY_TYPE = {"pixtral": {"clip.vision.spatial_merge_size"},
                 "gemma3": {"clip.vision.projector.scale_factor"},
                 "qwen2vl_merger": {"clip.vision.spatial_merge_size"},
                 "qwen2.5vl_merger": {"clip.vision.spatial_merge_size", "clip.vision.n_wa_pattern",
                                      "clip.vision.window_size"},
                 "qwen3vl_merger": {"clip.vision.spatial_merge_size", "clip.vision.is_deepstack_layers"}}
PROJECTOR_TYPES = tuple(_READ_BY_TYPE)
_QWEN_KINDS = {"qwen2vl_merger": "qwen2_vl", "qwen2.5vl_merger": "qwen2_5_vl", "qwen3vl_merger": "qwen3_vl"}
# the MLP activation llama.cpp runs (clip.use_gelu: ggml's tanh GELU, clip.use_silu, else quick
# GELU) -> the family's name for it, where the family's HF checkpoints run it
_ACTS = {"pixtral": {"gelu": "gelu", "silu": "silu"}, "gemma3": {"gelu": "gelu_pytorch_tanh"},
         "qwen2vl_merger": {"gelu_quick": "quick_gelu"}, "qwen2.5vl_merger": {"silu": "silu"},
         "qwen3vl_merger": {"gelu": "gelu_pytorch_tanh"}}
_ROPE_THETA = 10000.0  # clip.cpp's for Pixtral's and Qwen's towers (the file has no key for it)
_GEMMA3_TOKENS = ("<start_of_image>", "<image_soft_token>", "<end_of_image>")


def mmproj_vision_config(path: str | Path, text: ModelConfig, text_md: dict[str, Any]) -> VisionConfig:
    """The image side an mmproj file gives the text GGUF's model (`text`, whose metadata is
    `text_md`); ValueError naming what ember does not run."""
    from ember.loader.gguf import open_gguf

    f = open_gguf(Path(path))
    md = f.metadata
    if md.get("general.architecture") != "clip" or md.get("general.type", "mmproj") != "mmproj":
        raise ValueError(f"--mmproj {path}: not an mmproj file (general.architecture "
                         f"{md.get('general.architecture')!r}, general.type {md.get('general.type')!r}); give the "
                         "file convert_hf_to_gguf.py --mmproj writes")
    if not md.get("clip.has_vision_encoder"):
        raise ValueError(f"--mmproj {path}: the file has no vision encoder (an audio one?): ember runs images only")
    kind = md.get("clip.projector_type")
    if kind not in PROJECTOR_TYPES:
        raise ValueError(f"--mmproj {path}: projector type {kind!r} is not supported: ember runs the mmproj files of "
                         f"{', '.join(PROJECTOR_TYPES)} (Pixtral, Mistral 3, Gemma 3, Qwen2-VL, Qwen2.5-VL, "
                         "Qwen3-VL); serve other models from their HF directory")
    if unread := sorted(k for k in md if k.startswith("clip.") and k not in _READ | _READ_BY_TYPE[kind]):
        raise ValueError(f"--mmproj {path}: ember does not honour {', '.join(unread)}: this file's tower is not one "
                         "ember runs as llama.cpp would")
    op = "silu" if md.get("clip.use_silu") else "gelu" if md.get("clip.use_gelu") else "gelu_quick"
    if op not in _ACTS[kind]:
        raise ValueError(f"--mmproj {path}: a {kind} tower with the MLP activation {op} (clip.use_gelu / "
                         f"clip.use_silu) is not supported: ember runs {kind}'s with {', '.join(_ACTS[kind])}")
    eps = _decimal(md["clip.vision.attention.layer_norm_epsilon"])
    vocab = list(text_md.get("tokenizer.ggml.tokens") or [])
    common = dict(hidden_size=md["clip.vision.embedding_length"], intermediate_size=md["clip.vision.feed_forward_length"],
                  num_layers=md["clip.vision.block_count"], num_heads=md["clip.vision.attention.head_count"],
                  image_size=md["clip.vision.image_size"], patch_size=md["clip.vision.patch_size"], num_channels=3,
                  layer_norm_eps=eps, hidden_act=_ACTS[kind][op],
                  image_mean=tuple(_decimal(x) for x in md["clip.vision.image_mean"]),
                  image_std=tuple(_decimal(x) for x in md["clip.vision.image_std"]),
                  text_hidden_size=text.hidden_size)
    if kind == "pixtral":
        vision = _pixtral(md, f.tensor_names, text, vocab, common)
    elif kind == "gemma3":
        vision = _gemma3(path, md, text, vocab, common)
    else:
        vision = _qwen(path, md, kind, text, text_md, vocab, common)
    if md["clip.vision.projection_dim"] != text.hidden_size:
        raise ValueError(f"--mmproj {path}: its projector makes embeddings of {md['clip.vision.projection_dim']}, the "
                         f"text model's are {text.hidden_size}: give the mmproj converted from the same checkpoint")
    return vision


def _pixtral(md: dict[str, Any], tensor_names: list[str], text: ModelConfig, vocab: list[str],
             common: dict[str, Any]) -> VisionConfig:
    if "[IMG]" not in vocab:
        raise ValueError(f"the model {text.architecture} has no [IMG] token in its vocabulary: it takes no images, "
                         "so an mmproj file cannot go with it")
    return VisionConfig(kind="mistral3" if "mm.patch_merger.weight" in tensor_names else "pixtral",
                        image_token_id=vocab.index("[IMG]"), projector_bias="mm.1.bias" in tensor_names,
                        merge_size=int(md.get("clip.vision.spatial_merge_size", 1)), rope_theta=_ROPE_THETA,
                        projector_norm_eps=common["layer_norm_eps"], **common)


def _gemma3(path: str | Path, md: dict[str, Any], text: ModelConfig, vocab: list[str],
            common: dict[str, Any]) -> VisionConfig:
    if text.architecture != "gemma3":
        raise ValueError(f"--mmproj {path}: a Gemma 3 tower goes with a Gemma 3 language model, not "
                         f"{text.architecture}: give the text GGUF converted from the same checkpoint")
    if missing := [t for t in _GEMMA3_TOKENS if t not in vocab]:
        raise ValueError(f"the model's vocabulary has no {', '.join(missing)}: Gemma 3 lays each image out as "
                         f"{' '.join(_GEMMA3_TOKENS)}, so an mmproj file cannot go with it")
    side = common["image_size"] // common["patch_size"]
    scale = int(md.get("clip.vision.projector.scale_factor", 4))  # clip.cpp's default, Gemma 3's
    if common["image_size"] % common["patch_size"] or side % scale:
        raise ValueError(f"--mmproj {path}: clip.vision.projector.scale_factor {scale} does not divide the tower's "
                         f"{common['image_size']} / {common['patch_size']} patches a side")
    return VisionConfig(kind="gemma3", image_token_id=vocab.index(_GEMMA3_TOKENS[1]),
                        mm_tokens_per_image=(side // scale) ** 2, **common)


def _qwen(path: str | Path, md: dict[str, Any], projector: str, text: ModelConfig, text_md: dict[str, Any],
          vocab: list[str], common: dict[str, Any]) -> VisionConfig:
    kind = _QWEN_KINDS[projector]
    interleaved = kind == "qwen3_vl"
    if text.mrope_section is None or text.mrope_interleaved != interleaved:
        raise ValueError(f"--mmproj {path}: a {projector} tower goes with llama.cpp's "
                         f"{'qwen3vl' if interleaved else 'qwen2vl'} language model (M-RoPE"
                         f"{', interleaved' if interleaved else ''}), not this {text.architecture} GGUF: give the text "
                         "GGUF converted from the same checkpoint")
    if missing := [t for t in ("<|image_pad|>", "<|video_pad|>") if t not in vocab]:
        raise ValueError(f"the model's vocabulary has no {', '.join(missing)}: Qwen's image and video tokens, so an "
                         "mmproj file cannot go with it")
    layers = common["num_layers"]
    extra: dict[str, Any] = {}
    if kind == "qwen2_5_vl":
        pattern = int(md["clip.vision.n_wa_pattern"])
        extra = dict(window_size=int(md.get("clip.vision.window_size", 112)),  # clip.cpp's default
                     full_attention_blocks=tuple(i for i in range(layers) if (i + 1) % pattern == 0))
    elif kind == "qwen3_vl":
        flags = [bool(x) for x in md.get("clip.vision.is_deepstack_layers") or ()]
        deepstack = tuple(i for i, on in enumerate(flags) if on)
        if len(flags) != layers or len(deepstack) != text_md.get("qwen3vl.n_deepstack_layers", 0):
            raise ValueError(f"--mmproj {path}: clip.vision.is_deepstack_layers ({len(deepstack)} of {len(flags)} "
                             f"blocks) does not fit the tower's {layers} blocks and the text model's "
                             f"qwen3vl.n_deepstack_layers {text_md.get('qwen3vl.n_deepstack_layers')}: give the pair "
                             "converted from the same checkpoint")
        extra = dict(num_position_embeddings=(common["image_size"] // common["patch_size"]) ** 2,
                     deepstack_blocks=deepstack)
    # no image size: an image's follows its own (clip.cpp's image_size is a warm-up size, and the side of
    # Qwen3-VL's learned grid); the video token only marks what a prompt may not hold (mtmd takes no video)
    return VisionConfig(kind=kind, image_token_id=vocab.index("<|image_pad|>"),
                        video_token_id=vocab.index("<|video_pad|>"), temporal_patch_size=2,
                        merge_size=int(md.get("clip.vision.spatial_merge_size", 2)), rope_theta=_ROPE_THETA,
                        **(common | {"image_size": 0}), **extra)


def _decimal(x: float) -> float:
    """A float32 metadata value as the decimal it was written from (1e-05, not 9.99999974e-06)."""
    return float(str(np.float32(x)))


# GGUF name -> ember's, per projector type (regex, replacement), the first that matches
_SIGLIP_NAMES = (
    (r"v\.patch_embd\.", "vision_tower.embeddings.patch_embedding."),
    (r"v\.position_embd\.", "vision_tower.embeddings.position_embedding."),
    (r"v\.blk\.(\d+)\.attn_(q|k|v)\.", r"vision_tower.encoder.layers.\1.self_attn.\2_proj."),
    (r"v\.blk\.(\d+)\.attn_out\.", r"vision_tower.encoder.layers.\1.self_attn.out_proj."),
    (r"v\.blk\.(\d+)\.ln(1|2)\.", r"vision_tower.encoder.layers.\1.layer_norm\2."),
    (r"v\.blk\.(\d+)\.ffn_up\.", r"vision_tower.encoder.layers.\1.mlp.fc1."),
    (r"v\.blk\.(\d+)\.ffn_down\.", r"vision_tower.encoder.layers.\1.mlp.fc2."),
    (r"v\.post_ln\.", "vision_tower.post_layernorm."),
    (r"mm\.soft_emb_norm\.", "multi_modal_projector.mm_soft_emb_norm."),
    (r"mm\.input_projection\.weight", "multi_modal_projector.mm_input_projection_weight"),
)
_QWEN_BLOCKS = (
    (r"v\.blk\.(\d+)\.attn_(q|k|v|qkv)\.", r"blocks.\1.attn.\2."),  # q, k, v: parts of qkv (joined below)
    (r"v\.blk\.(\d+)\.attn_out\.", r"blocks.\1.attn.proj."),
    (r"v\.blk\.(\d+)\.ln(1|2)\.", r"blocks.\1.norm\2."),
    (r"v\.patch_embd\.", "patch_embed.proj."),
)
_QWEN2_MERGER = ((r"v\.post_ln\.", "merger.ln_q."), (r"mm\.(0|2)\.", r"merger.mlp.\1."))
_FC = ((r"v\.blk\.(\d+)\.ffn_up\.", r"blocks.\1.mlp.fc1."), (r"v\.blk\.(\d+)\.ffn_down\.", r"blocks.\1.mlp.fc2."))
_NAMES = {
    "gemma3": _SIGLIP_NAMES,
    "qwen2vl_merger": _QWEN_BLOCKS + _FC + _QWEN2_MERGER,
    "qwen2.5vl_merger": _QWEN_BLOCKS + ((r"v\.blk\.(\d+)\.ffn_(gate|up|down)\.", r"blocks.\1.mlp.\2_proj."),)
    + _QWEN2_MERGER,
    "qwen3vl_merger": _QWEN_BLOCKS + _FC + (
        (r"v\.position_embd\.", "pos_embed."), (r"v\.post_ln\.", "merger.norm."), (r"mm\.0\.", "merger.linear_fc1."),
        (r"mm\.2\.", "merger.linear_fc2."), (r"v\.deepstack\.(\d+)\.norm\.", r"deepstack.\1.norm."),
        (r"v\.deepstack\.(\d+)\.fc(1|2)\.", r"deepstack.\1.linear_fc\2.")),
}


def iter_mmproj_weights(path: str | Path, vision: VisionConfig, hf_names: list[str]
                        ) -> Iterator[tuple[str, torch.Tensor]]:
    """The mmproj file's tensors as (ember's name, float32 tensor), for the vision model whose
    parameters are `hf_names`; a tensor of no such name is yielded under its GGUF name (the
    loader then names it), but for Pixtral's [IMG_BREAK] embedding, which the text model's
    vocabulary holds too."""
    from ember.loader.gguf import gguf_to_hf_names, open_gguf, unpermute_rows

    f = open_gguf(Path(path))
    kind = f.metadata["clip.projector_type"]
    if kind == "pixtral":
        names = gguf_to_hf_names("clip", hf_names, vision.num_layers)
        for gguf_name in f.tensor_names:
            if gguf_name == "v.token_embd.img_break":
                continue
            name = names.get(gguf_name, gguf_name)
            w = f.tensor(gguf_name)
            if name.endswith((".q_proj.weight", ".k_proj.weight")):
                w = unpermute_rows(w, vision.num_heads)
            yield name, w
        return
    parts: dict[str, dict[str, torch.Tensor]] = {}  # a fused tensor's parts, until all are read
    for gguf_name in f.tensor_names:
        name, w = _renamed(gguf_name, kind, vision), f.tensor(gguf_name)
        if name.endswith("mm_soft_emb_norm.weight"):
            w = w - 1  # stored as 1 + w (Gemma3RMSNorm's scale); the norm's weight_loader adds the 1
        if (m := re.fullmatch(r"(blocks\.\d+\.attn\.)(q|k|v)\.(weight|bias)", name)) is not None:
            name, part = f"{m[1]}qkv.{m[3]}", m[2]
        elif (m := re.fullmatch(r"(patch_embed\.proj\.weight)(\.1)?", name)) is not None:
            name, part = m[1], "frame1" if m[2] else "frame0"  # Conv3d's two frames, one Conv2d each
        else:
            yield name, w
            continue
        got = parts.setdefault(name, {})
        got[part] = w
        order = ("frame0", "frame1") if name.startswith("patch_embed") else ("q", "k", "v")
        if len(got) == len(order):
            del parts[name]
            yield name, torch.stack([got[p] for p in order], dim=2) if order[0] == "frame0" else \
                torch.cat([got[p] for p in order])
    if parts:
        name, got = next(iter(parts.items()))
        raise ValueError(f"--mmproj {path}: {name} has only {', '.join(got)} of its parts: the file is incomplete")


def _renamed(gguf_name: str, kind: str, vision: VisionConfig) -> str:
    """ember's name of an mmproj tensor (its GGUF name where none fits): Qwen3-VL's deepstack
    mergers, which the file numbers by tower block, by their place among them."""
    for pattern, repl in _NAMES[kind]:
        if (m := re.match(pattern, gguf_name)) is not None:
            name = m.expand(repl) + gguf_name[m.end():]
            if name.startswith("deepstack."):
                block = int(name.split(".")[1])
                if block not in vision.deepstack_blocks:
                    return gguf_name
                name = f"deepstack_merger_list.{vision.deepstack_blocks.index(block)}." + name.split(".", 2)[2]
            return name
    return gguf_name
