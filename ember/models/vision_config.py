"""VisionConfig: what ember reads of a vision-language checkpoint's image side (its vision
tower, the projector into the language model, the image token), from config.json.

One reader a family (`kind`): LLaVA-1.5's CLIP tower and linear-GELU-linear projector, and
LLaVA-NeXT's (the same over the tiles of its anyres grid: models/llava_next.py);
Qwen2-VL's and Qwen2.5-VL's towers of dynamic resolution (models/qwen2_vl.py: patches of any
image size, merged 2 x 2 into the language model's tokens, whose positions are M-RoPE's), and
Qwen3-VL's (models/qwen3_vl.py: learned positions interpolated to the grid, deepstack mergers);
Pixtral's tower of variable resolution (models/pixtral.py: 2-D RoPE over each image's patch grid,
its rows of [IMG] tokens ended by [IMG_BREAK] / [IMG_END]) under LLaVA's projector ("pixtral",
mistral-community/pixtral-12b) or Mistral 3's (RMSNorm, a merger of merge x merge patches, then
the projector: "mistral3", Mistral-Small-3.1); Gemma 3's SigLIP tower and its projector (models/siglip.py,
gemma3_vision.py: a fixed image size, the patches average-pooled to mm_tokens_per_image, whose
tokens attend to each other both ways in the language model: `bidirectional_images`). A field the
family's config sets that ember does not run is refused here, by name.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any


@dataclass(frozen=True)
class VisionConfig:
    # "llava": a CLIP tower, a feature layer, linear-act-linear into the text model;
    # "llava_next": the same over an image's base view and the tiles of its anyres grid;
    # "qwen2_vl" / "qwen2_5_vl": models/qwen2_vl.py's tower and patch merger; "qwen3_vl":
    # models/qwen3_vl.py's (the same blocks, learned positions, deepstack mergers);
    # "pixtral" / "mistral3": models/pixtral.py's tower and LLaVA's / Mistral 3's projector;
    # "gemma3": models/siglip.py's tower and models/gemma3_vision.py's projector
    kind: str
    image_token_id: int  # the placeholder token each image's embeddings take the place of
    hidden_size: int  # the tower's
    intermediate_size: int
    num_layers: int  # the tower layers that run: up to the feature layer
    num_heads: int
    patch_size: int
    num_channels: int
    layer_norm_eps: float
    hidden_act: str  # the tower's MLP activation (CLIP: quick_gelu; SigLIP: gelu_pytorch_tanh)
    text_hidden_size: int
    # LLaVA: a fixed image size; the CLS position dropped ("default" strategy); the projector's
    image_size: int = 0
    drop_cls: bool = False
    projector_act: str = "gelu"
    projector_bias: bool = True
    # Qwen2-VL: frames taken temporal_patch_size at a time into a patch (an image is repeated),
    # merge_size x merge_size patches into one token; Qwen2.5-VL: attention within windows of
    # window_size pixels but in full_attention_blocks, RMSNorm and a gated MLP
    temporal_patch_size: int = 1
    merge_size: int = 1
    window_size: int = 0
    full_attention_blocks: tuple[int, ...] = ()
    rope_theta: float = 10000.0  # the tower's 2-D RoPE
    # Qwen2-VL's family: the placeholder token of a video's frames (0: the family takes no video)
    video_token_id: int = 0
    # Qwen2.5-VL: a video's temporal position per second of it (vision_config.tokens_per_second)
    tokens_per_second: float = 0.0
    # Qwen3-VL: the learned position table (a side x side grid, interpolated to each image's), and
    # the tower blocks after which a deepstack merger's output goes to the text model's layers
    # 0, 1, ... (added at the image tokens' rows)
    num_position_embeddings: int = 0
    deepstack_blocks: tuple[int, ...] = ()
    # LLaVA-NeXT: the (height, width) in pixels an image's tiles may cover (image_grid_pinpoints)
    grid_pinpoints: tuple[tuple[int, int], ...] = ()
    # Mistral 3: the projector's RMSNorm (the text model's rms_norm_eps) before the patch merger
    projector_norm_eps: float = 1e-5
    # an mmproj GGUF's image normalization (clip.vision.image_mean / image_std), which its image
    # processor is made with; empty for an HF directory, whose preprocessor_config.json has it
    image_mean: tuple[float, ...] = ()
    image_std: tuple[float, ...] = ()
    # Gemma 3: the tokens an image's patches are average-pooled to (a square number)
    mm_tokens_per_image: int = 0

    @property
    def dynamic_resolution(self) -> bool:
        """Qwen2-VL's: an image's token count follows its size (its grid), none is fixed."""
        return self.kind in QWEN_VL_KINDS

    @property
    def row_tokens(self) -> bool:
        """Pixtral's: an image's tokens are rows of image tokens, each row ended by a break token
        (the last by an end token) that keeps its text embedding."""
        return self.kind in PIXTRAL_KINDS

    @property
    def bidirectional_images(self) -> bool:
        """Gemma 3's: an image's tokens attend to each other both ways in the language model
        (transformers' token_type_ids mask), so a prefill chunk never ends inside an image."""
        return self.kind == "gemma3"

    @property
    def tokens_per_image(self) -> int:
        if self.mm_tokens_per_image:
            return self.mm_tokens_per_image
        return (self.image_size // self.patch_size) ** 2 + (0 if self.drop_cls else 1)


QWEN_VL_KINDS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
PIXTRAL_KINDS = ("pixtral", "mistral3")


# vision-language architectures ember runs images through -> how their config.json is read
def vision_config(config: dict[str, Any], text_hidden_size: int) -> VisionConfig | None:
    """The image side of a vision-language config.json; None for one ember serves as text only
    (Llama 4's vision tower is not run yet)."""
    arch = (config.get("architectures") or [""])[0]
    if arch == "LlavaForConditionalGeneration":
        return _llava(config, text_hidden_size)
    if arch in _QWEN_VL_ARCHITECTURES:
        return _qwen_vl(config, _QWEN_VL_ARCHITECTURES[arch])
    if arch == "LlavaNextForConditionalGeneration":
        return _llava_next(config, text_hidden_size)
    if arch == "Mistral3ForConditionalGeneration":
        return _pixtral(config, text_hidden_size, "mistral3")
    if arch == "Gemma3ForConditionalGeneration":
        return _gemma3(config, text_hidden_size)
    return None


_QWEN_VL_ARCHITECTURES = {"Qwen2VLForConditionalGeneration": "qwen2_vl",
                          "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl",
                          "Qwen3VLForConditionalGeneration": "qwen3_vl"}
# the towers' MLP activations ember runs (Qwen2-VL's and Qwen3-VL's fc1-act-fc2, Qwen2.5-VL's gated one)
_QWEN_VL_ACTS = {"qwen2_vl": ("quick_gelu", "gelu"), "qwen2_5_vl": ("silu", "gelu"),
                 "qwen3_vl": ("gelu_pytorch_tanh", "gelu")}


def _qwen_vl(config: dict[str, Any], kind: str) -> VisionConfig:
    """Qwen2-VL's vision_config (embed_dim, mlp_ratio; hidden_size is the merger's output),
    Qwen2.5-VL's (hidden_size, intermediate_size, out_hidden_size, window attention) or Qwen3-VL's
    (Qwen2.5-VL's sizes, learned positions, deepstack_visual_indexes)."""
    arch = config["architectures"][0]
    vc = config.get("vision_config") or {}
    rope = vc.get("rope_parameters") or vc.get("rope_scaling") or {}
    if rope.get("rope_type", "axial") != "axial":
        raise ValueError(f"{arch} with a vision rope_type {rope.get('rope_type')!r} is not supported: ember runs "
                         "the tower's axial (h, w) RoPE")
    act = vc.get("hidden_act", {"qwen2_vl": "quick_gelu", "qwen2_5_vl": "silu", "qwen3_vl": "gelu_pytorch_tanh"}[kind])
    if act not in _QWEN_VL_ACTS[kind]:
        raise ValueError(f"{arch}: the tower's hidden_act {act!r} is not supported (ember runs "
                         f"{_QWEN_VL_ACTS[kind]})")
    depth = vc.get("depth", 27 if kind == "qwen3_vl" else 32)
    if kind == "qwen2_vl":
        hidden = vc.get("embed_dim", 1280)
        sizes = {"hidden_size": hidden, "intermediate_size": int(hidden * vc.get("mlp_ratio", 4)),
                 "text_hidden_size": vc.get("hidden_size", 3584)}
    elif kind == "qwen2_5_vl":
        hidden = vc.get("hidden_size", 1280)
        sizes = {"hidden_size": hidden, "intermediate_size": vc.get("intermediate_size", 3420),
                 "text_hidden_size": vc.get("out_hidden_size", 3584)}
    else:
        sizes = _qwen3_vl(vc, arch, depth)
    full = tuple(vc.get("fullatt_block_indexes", (7, 15, 23, 31))) if kind == "qwen2_5_vl" else ()
    if any(not 0 <= i < depth for i in full):
        raise ValueError(f"{arch}: fullatt_block_indexes {list(full)} name blocks outside the tower's {depth}")
    return VisionConfig(
        kind=kind,
        image_token_id=config.get("image_token_id", 151655),
        video_token_id=config.get("video_token_id", 151656),
        tokens_per_second=float(vc.get("tokens_per_second", 4)) if kind == "qwen2_5_vl" else 0.0,
        num_layers=depth,
        num_heads=vc.get("num_heads", 16),
        patch_size=vc.get("patch_size", 16 if kind == "qwen3_vl" else 14),
        num_channels=vc.get("in_channels", vc.get("in_chans", 3)),
        layer_norm_eps=1e-6,
        hidden_act=act,
        temporal_patch_size=vc.get("temporal_patch_size", 2),
        merge_size=vc.get("spatial_merge_size", 2),
        window_size=vc.get("window_size", 112) if kind == "qwen2_5_vl" else 0,
        full_attention_blocks=full,
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        **sizes,
    )


def _qwen3_vl(vc: dict[str, Any], arch: str, depth: int) -> dict[str, Any]:
    """Qwen3-VL's sizes, learned position grid and deepstack blocks (Qwen3VLVisionConfig's defaults)."""
    positions = int(vc.get("num_position_embeddings", 2304))
    side = int(positions ** 0.5)
    if side * side != positions:
        raise ValueError(f"{arch}: num_position_embeddings {positions} is not a square grid of learned positions")
    deepstack = tuple(int(i) for i in vc.get("deepstack_visual_indexes", (8, 16, 24)))
    if any(not 0 <= i < depth for i in deepstack) or list(deepstack) != sorted(set(deepstack)):
        raise ValueError(f"{arch}: deepstack_visual_indexes {list(deepstack)} must name distinct tower blocks in "
                         f"order, within the tower's {depth}")
    return {"num_position_embeddings": positions, "deepstack_blocks": deepstack,
            "hidden_size": vc.get("hidden_size", 1152), "intermediate_size": vc.get("intermediate_size", 4304),
            "text_hidden_size": vc.get("out_hidden_size", 3584)}


def _feature_layers(config: dict[str, Any], layers: int, default: int) -> int:
    """The tower layers that run: up to vision_feature_layer (`default` where config.json has
    none; one layer, an int; hidden_states[0] is the embeddings' output)."""
    layer = config.get("vision_feature_layer", default)
    if not isinstance(layer, int):
        raise ValueError(f"{config['architectures'][0]} with vision_feature_layer {layer!r} (several layers "
                         "concatenated) is not supported: ember takes one layer's features (an int)")
    used = layers + layer + 1 if layer < 0 else layer
    if not 0 < used <= layers:
        raise ValueError(f"vision_feature_layer {layer} is outside the tower's {layers} layers")
    return used


_CLIP_ACTS = ("quick_gelu", "gelu")
# CLIPVisionConfig's defaults, for the keys a vision_config leaves out; LlavaConfig's tower
# where there is no vision_config at all
_CLIP_DEFAULTS = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
                  "image_size": 224, "patch_size": 32, "num_channels": 3, "layer_norm_eps": 1e-5,
                  "hidden_act": "quick_gelu", "model_type": "clip_vision_model"}
_LLAVA_TOWER = _CLIP_DEFAULTS | {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24,
                                 "num_attention_heads": 16, "image_size": 336, "patch_size": 14}
_PROJECTOR_ACTS = ("gelu",)


def _llava(config: dict[str, Any], text_hidden_size: int) -> VisionConfig:
    arch = config["architectures"][0]
    given = config.get("vision_config")
    if given and given.get("model_type") == "pixtral" and arch == "LlavaForConditionalGeneration":
        return _pixtral(config, text_hidden_size, "pixtral")
    vc = (_CLIP_DEFAULTS | given) if given else _LLAVA_TOWER
    if vc["model_type"] != "clip_vision_model":
        raise ValueError(f"{arch} with a {vc.get('model_type')!r} vision tower is not supported: ember runs "
                         "LLaVA's CLIP tower (clip_vision_model) and Pixtral's (pixtral)")
    used = _feature_layers(config, vc["num_hidden_layers"], -2)
    strategy = config.get("vision_feature_select_strategy", "default")
    if strategy not in ("default", "full"):
        raise ValueError(f"vision_feature_select_strategy {strategy!r} is not supported: ember runs 'default' "
                         "(the CLS position dropped) and 'full'")
    act, projector_act = vc["hidden_act"], config.get("projector_hidden_act", "gelu")
    if act not in _CLIP_ACTS or projector_act not in _PROJECTOR_ACTS:
        raise ValueError(f"{arch}: the tower's hidden_act {act!r} / projector_hidden_act "
                         f"{projector_act!r} is not supported (ember runs {_CLIP_ACTS} / {_PROJECTOR_ACTS})")
    return VisionConfig(
        kind="llava",
        image_token_id=config.get("image_token_index", config.get("image_token_id", 32000)),
        **_hf_tower(vc, used, vc["layer_norm_eps"]),
        hidden_act=act,
        drop_cls=strategy == "default",
        projector_act=projector_act,
        projector_bias=bool(config.get("multimodal_projector_bias", True)),
        text_hidden_size=text_hidden_size,
    )


def _hf_tower(vc: dict[str, Any], num_layers: int, layer_norm_eps: float) -> dict[str, Any]:
    """A CLIP-like tower's sizes from its HF vision_config (CLIP, SigLIP, Pixtral), with the
    layers ember runs and the norms' epsilon, as VisionConfig's fields."""
    return dict(hidden_size=vc["hidden_size"], intermediate_size=vc["intermediate_size"], num_layers=num_layers,
                num_heads=vc["num_attention_heads"], image_size=vc["image_size"], patch_size=vc["patch_size"],
                num_channels=vc["num_channels"], layer_norm_eps=layer_norm_eps)


# LlavaNextConfig's image_grid_pinpoints where config.json names none
_LLAVA_NEXT_PINPOINTS = ((336, 672), (672, 336), (672, 672), (1008, 336), (336, 1008))


def _llava_next(config: dict[str, Any], text_hidden_size: int) -> VisionConfig:
    """LLaVA-1.5's reading, plus the anyres grid: each pinpoint a whole number of tiles of the
    tower's image_size (what transformers' tiling and unpadding assume)."""
    if config.get("vision_feature_select_strategy", "default") != "default":
        raise ValueError(f"LlavaNextForConditionalGeneration with vision_feature_select_strategy "
                         f"{config['vision_feature_select_strategy']!r} is not supported: its tiles' features are a "
                         "grid of patches only with the CLS position dropped ('default')")
    base = _llava(config, text_hidden_size)
    pinpoints = tuple(tuple(int(x) for x in p) for p in config.get("image_grid_pinpoints") or _LLAVA_NEXT_PINPOINTS)
    side = base.image_size
    if any(len(p) != 2 or p[0] < side or p[1] < side or p[0] % side or p[1] % side for p in pinpoints):
        raise ValueError(f"LlavaNextForConditionalGeneration: image_grid_pinpoints {[list(p) for p in pinpoints]} "
                         f"must each be (height, width) multiples of the tower's image_size {side}")
    return replace(base, kind="llava_next", grid_pinpoints=pinpoints)


# PixtralVisionConfig's defaults, for the keys a vision_config leaves out
_PIXTRAL_DEFAULTS = {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24, "num_attention_heads": 16,
                     "num_channels": 3, "image_size": 1024, "patch_size": 16, "hidden_act": "gelu"}
_PIXTRAL_ACTS = ("gelu", "silu")


def _pixtral(config: dict[str, Any], text_hidden_size: int, kind: str) -> VisionConfig:
    """Pixtral's tower under LLaVA's projector (kind "pixtral": LlavaConfig, the feature select
    strategy "full") or Mistral 3's (kind "mistral3": Mistral3Config's RMSNorm and patch merger,
    no projector bias by default)."""
    arch = config["architectures"][0]
    vc = _PIXTRAL_DEFAULTS | (config.get("vision_config") or {})
    rope = vc.get("rope_parameters") or vc.get("rope_scaling") or {}
    if rope.get("rope_type", "axial") != "axial":
        raise ValueError(f"{arch} with a vision rope_type {rope.get('rope_type')!r} is not supported: ember runs "
                         "Pixtral's axial (row, column) RoPE")
    # Mistral3Config's default feature layer / LlavaConfig's
    used = _feature_layers(config, vc["num_hidden_layers"], -1 if kind == "mistral3" else -2)
    if kind == "pixtral" and config.get("vision_feature_select_strategy", "default") != "full":
        raise ValueError(f"{arch} with a pixtral tower and vision_feature_select_strategy "
                         f"{config.get('vision_feature_select_strategy', 'default')!r} is not supported: a Pixtral "
                         "tower has no CLS position to drop; ember runs 'full' (as pixtral-12b's config.json)")
    act, projector_act = vc["hidden_act"], config.get("projector_hidden_act", "gelu")
    if act not in _PIXTRAL_ACTS or projector_act not in _PROJECTOR_ACTS:
        raise ValueError(f"{arch}: the tower's hidden_act {act!r} / projector_hidden_act {projector_act!r} is not "
                         f"supported (ember runs {_PIXTRAL_ACTS} / {_PROJECTOR_ACTS})")
    text = config.get("text_config") or {}
    return VisionConfig(
        kind=kind,
        image_token_id=config.get("image_token_index", config.get("image_token_id",
                                                                  10 if kind == "mistral3" else 32000)),
        **_hf_tower(vc, used, 1e-5),  # modeling_pixtral.py's eps, not in config.json
        hidden_act=act,
        projector_act=projector_act,
        projector_bias=bool(config.get("multimodal_projector_bias", kind == "pixtral")),
        merge_size=config.get("spatial_merge_size", 2) if kind == "mistral3" else 1,
        rope_theta=float(rope.get("rope_theta", vc.get("rope_theta", 10000.0))),
        projector_norm_eps=float(text.get("rms_norm_eps", 1e-6)),  # MistralConfig's
        text_hidden_size=text_hidden_size,
    )


# SiglipVisionConfig's defaults, for the keys a vision_config leaves out
_SIGLIP_DEFAULTS = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
                    "num_channels": 3, "image_size": 224, "patch_size": 16, "hidden_act": "gelu_pytorch_tanh",
                    "layer_norm_eps": 1e-6, "model_type": "siglip_vision_model"}
_SIGLIP_ACTS = ("gelu_pytorch_tanh", "gelu")


def _gemma3(config: dict[str, Any], text_hidden_size: int) -> VisionConfig:
    """Gemma3Config's image side: a SigLIP tower (its last layer, post_layernorm; the pooling head,
    where vision_use_head keeps one, is not read) and the projector pooling its patch grid to
    mm_tokens_per_image tokens."""
    arch = config["architectures"][0]
    vc = _SIGLIP_DEFAULTS | (config.get("vision_config") or {})
    if vc["model_type"] != "siglip_vision_model":
        raise ValueError(f"{arch} with a {vc['model_type']!r} vision tower is not supported: ember runs Gemma 3's "
                         "SigLIP tower (siglip_vision_model)")
    if vc["hidden_act"] not in _SIGLIP_ACTS:
        raise ValueError(f"{arch}: the tower's hidden_act {vc['hidden_act']!r} is not supported (ember runs "
                         f"{_SIGLIP_ACTS})")
    tokens = int(config.get("mm_tokens_per_image", 256))
    side, per_side = vc["image_size"] // vc["patch_size"], round(tokens ** 0.5)
    if vc["image_size"] % vc["patch_size"] or per_side * per_side != tokens or side % per_side:
        raise ValueError(f"{arch}: mm_tokens_per_image {tokens} must be a square whose side divides the tower's "
                         f"{vc['image_size']} / {vc['patch_size']} patches a side (its average pool's kernel)")
    return VisionConfig(
        kind="gemma3",
        image_token_id=config.get("image_token_index", config.get("image_token_id", 262144)),
        **_hf_tower(vc, vc["num_hidden_layers"], float(vc["layer_norm_eps"])),
        hidden_act=vc["hidden_act"],
        mm_tokens_per_image=tokens,
        text_hidden_size=text_hidden_size,
    )
