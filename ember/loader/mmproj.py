"""llama.cpp's mmproj GGUF files (`convert_hf_to_gguf.py --mmproj`; llama-server's `--mmproj`):
a vision tower and its projector, beside the text GGUF the same converter writes for the
language model. ember runs those of Pixtral's tower (clip.projector_type "pixtral": pixtral-12b,
and Mistral-Small-3.1 with its patch merger), models/pixtral.py, from the file's metadata:

    clip.vision.{embedding_length, feed_forward_length, block_count, attention.head_count,
    patch_size, image_size (the longest side), attention.layer_norm_epsilon, image_mean,
    image_std, spatial_merge_size}, clip.use_gelu / clip.use_silu (the tower's MLP)

and what llama.cpp's clip.cpp fixes for Pixtral: a GELU projector, RoPE theta 10000, the
projector's RMSNorm at the tower's epsilon. The image token is the text vocabulary's "[IMG]".
A key ember does not honour, another projector type, a file without a vision encoder: refused
by name. Tensors take their HF names from gguf-py's table (the converter's, inverted), Q and K
rows un-permuted as the converter permuted them (LlamaModel.permute)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from ember.models.config import ModelConfig
from ember.models.vision_config import VisionConfig

# the metadata of an mmproj file ember reads (beside general.*), and those it reads as their
# only value: a file that sets any other clip.* key is refused
_READ = {"clip.has_vision_encoder", "clip.projector_type", "clip.vision.projection_dim", "clip.vision.image_size",
         "clip.vision.patch_size", "clip.vision.embedding_length", "clip.vision.feed_forward_length",
         "clip.vision.block_count", "clip.vision.attention.head_count", "clip.vision.image_mean",
         "clip.vision.image_std", "clip.vision.attention.layer_norm_epsilon", "clip.use_gelu", "clip.use_silu",
         "clip.vision.spatial_merge_size"}
PROJECTOR_TYPES = ("pixtral",)
_ROPE_THETA = 10000.0  # clip.cpp's for Pixtral (the file has no key for it)


def mmproj_vision_config(path: str | Path, text: ModelConfig, vocab: list[str]) -> VisionConfig:
    """The image side an mmproj file gives the text GGUF's model (`text`, whose vocabulary is
    `vocab`); ValueError naming what ember does not run."""
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
                         f"{', '.join(PROJECTOR_TYPES)} (Pixtral, Mistral 3); serve other models from their HF "
                         "directory")
    if unread := sorted(k for k in md if k.startswith("clip.") and k not in _READ):
        raise ValueError(f"--mmproj {path}: ember does not honour {', '.join(unread)}: this file's tower is not one "
                         "ember runs as llama.cpp would")
    if "[IMG]" not in vocab:
        raise ValueError(f"the model {text.architecture} has no [IMG] token in its vocabulary: it takes no images, "
                         "so an mmproj file cannot go with it")
    if md["clip.vision.projection_dim"] != text.hidden_size:
        raise ValueError(f"--mmproj {path}: its projector makes embeddings of {md['clip.vision.projection_dim']}, the "
                         f"text model's are {text.hidden_size}: give the mmproj converted from the same checkpoint")
    act = "silu" if md.get("clip.use_silu") else "gelu" if md.get("clip.use_gelu") else None
    if act is None:
        raise ValueError(f"--mmproj {path}: the tower's MLP activation is unset (clip.use_gelu / clip.use_silu)")
    merge = int(md.get("clip.vision.spatial_merge_size", 1))
    eps = _decimal(md["clip.vision.attention.layer_norm_epsilon"])
    return VisionConfig(
        kind="mistral3" if "mm.patch_merger.weight" in f.tensor_names else "pixtral",
        image_token_id=vocab.index("[IMG]"),
        hidden_size=md["clip.vision.embedding_length"],
        intermediate_size=md["clip.vision.feed_forward_length"],
        num_layers=md["clip.vision.block_count"],
        num_heads=md["clip.vision.attention.head_count"],
        image_size=md["clip.vision.image_size"],
        patch_size=md["clip.vision.patch_size"],
        num_channels=3,
        layer_norm_eps=eps,
        hidden_act=act,
        projector_bias="mm.1.bias" in f.tensor_names,
        merge_size=merge,
        rope_theta=_ROPE_THETA,
        projector_norm_eps=eps,
        image_mean=tuple(_decimal(x) for x in md["clip.vision.image_mean"]),
        image_std=tuple(_decimal(x) for x in md["clip.vision.image_std"]),
        text_hidden_size=text.hidden_size,
    )


def _decimal(x: float) -> float:
    """A float32 metadata value as the decimal it was written from (1e-05, not 9.99999974e-06)."""
    return float(str(np.float32(x)))


def iter_mmproj_weights(path: str | Path, vision: VisionConfig, hf_names: list[str]
                        ) -> Iterator[tuple[str, torch.Tensor]]:
    """The mmproj file's tensors as (HF name, float32 tensor), for the HF names `hf_names` (the
    vision model's parameters); a tensor of no HF name is yielded under its GGUF name (the
    loader then names it), but for the [IMG_BREAK] embedding, which the text model's
    vocabulary holds too."""
    from ember.loader.gguf import gguf_to_hf_names, open_gguf, unpermute_rows

    f = open_gguf(Path(path))
    names = gguf_to_hf_names("clip", hf_names, vision.num_layers)
    for gguf_name in f.tensor_names:
        if gguf_name == "v.token_embd.img_break":
            continue
        name = names.get(gguf_name, gguf_name)
        w = f.tensor(gguf_name)
        if name.endswith((".q_proj.weight", ".k_proj.weight")):
            w = unpermute_rows(w, vision.num_heads)
        yield name, w
