"""VisionConfig: what ember reads of a vision-language checkpoint's image side (its vision
tower, the projector into the language model, the image token), from config.json.

One reader a family (`kind`): LLaVA-1.5's CLIP tower and linear-GELU-linear projector now;
Gemma 3's SigLIP, Qwen2.5-VL's and Pixtral's towers are further kinds beside it. A field the
family's config sets that ember does not run is refused here, by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class VisionConfig:
    kind: str  # "llava": a CLIP tower, a feature layer, linear-act-linear into the text model
    image_token_id: int  # the placeholder token each image's embeddings take the place of
    hidden_size: int  # the tower's
    intermediate_size: int
    num_layers: int  # the tower layers that run: up to the feature layer
    num_heads: int
    image_size: int
    patch_size: int
    num_channels: int
    layer_norm_eps: float
    hidden_act: str  # the tower's MLP activation (CLIP: quick_gelu)
    drop_cls: bool  # vision_feature_select_strategy "default": the CLS position is not an image token
    projector_act: str
    projector_bias: bool
    text_hidden_size: int

    @property
    def tokens_per_image(self) -> int:
        return (self.image_size // self.patch_size) ** 2 + (0 if self.drop_cls else 1)


# vision-language architectures ember runs images through -> how their config.json is read
def vision_config(config: dict[str, Any], text_hidden_size: int) -> VisionConfig | None:
    """The image side of a vision-language config.json; None for one ember serves as text only
    (Gemma 3's and Llama 4's vision towers are not run yet)."""
    arch = (config.get("architectures") or [""])[0]
    if arch == "LlavaForConditionalGeneration":
        return _llava(config, text_hidden_size)
    return None


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
    given = config.get("vision_config")
    vc = (_CLIP_DEFAULTS | given) if given else _LLAVA_TOWER
    if vc["model_type"] != "clip_vision_model":
        raise ValueError(f"LlavaForConditionalGeneration with a {vc.get('model_type')!r} vision tower is not "
                         "supported: ember runs LLaVA-1.5's CLIP tower (clip_vision_model)")
    layer = config.get("vision_feature_layer", -2)
    if not isinstance(layer, int):
        raise ValueError(f"LlavaForConditionalGeneration with vision_feature_layer {layer!r} (several layers "
                         "concatenated) is not supported: ember takes one layer's features (an int)")
    layers = vc["num_hidden_layers"]
    used = layers + layer + 1 if layer < 0 else layer  # hidden_states[0] is the embeddings' output
    if not 0 < used <= layers:
        raise ValueError(f"vision_feature_layer {layer} is outside the tower's {layers} layers")
    strategy = config.get("vision_feature_select_strategy", "default")
    if strategy not in ("default", "full"):
        raise ValueError(f"vision_feature_select_strategy {strategy!r} is not supported: ember runs 'default' "
                         "(the CLS position dropped) and 'full'")
    act, projector_act = vc["hidden_act"], config.get("projector_hidden_act", "gelu")
    if act not in _CLIP_ACTS or projector_act not in _PROJECTOR_ACTS:
        raise ValueError(f"LlavaForConditionalGeneration: the tower's hidden_act {act!r} / projector_hidden_act "
                         f"{projector_act!r} is not supported (ember runs {_CLIP_ACTS} / {_PROJECTOR_ACTS})")
    return VisionConfig(
        kind="llava",
        image_token_id=config.get("image_token_index", config.get("image_token_id", 32000)),
        hidden_size=vc["hidden_size"],
        intermediate_size=vc["intermediate_size"],
        num_layers=used,
        num_heads=vc["num_attention_heads"],
        image_size=vc["image_size"],
        patch_size=vc["patch_size"],
        num_channels=vc["num_channels"],
        layer_norm_eps=vc["layer_norm_eps"],
        hidden_act=act,
        drop_cls=strategy == "default",
        projector_act=projector_act,
        projector_bias=bool(config.get("multimodal_projector_bias", True)),
        text_hidden_size=text_hidden_size,
    )
