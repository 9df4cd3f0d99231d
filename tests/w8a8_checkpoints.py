"""The plain-torch meaning of a W8A8 checkpoint (compressed-tensors `int-quantized`), written
from the scheme's definition and independent of ember's code, and the pieces of one for unit
tests (whole checkpoints the compressed-tensors library writes itself: tests/ct_checkpoints.py):

    quantization_config(static, weights)   config.json's quantization_config as compressed-tensors
                                           0.13 serializes llm-compressor's W8A8 preset (weights
                                           int8 per channel, activations int8 per token, dynamic)
                                           or its static variant (activations per tensor,
                                           calibrated: X.input_scale)
    quantize_weight(w, strategy, dtype)    compressed-tensors' calculate_qparams and quantize: s =
                                           max |w| / 127.5 a row (channel) or for the tensor,
                                           stored in the weight's dtype; q = round(clamp(w / s,
                                           -128, 127)) as int8
    reference_quantize / reference_linear  the W8A8 numbers: x quantized per token (s = max |x| /
                                           127, q in [-127, 127]) or by the static scale (q in
                                           [-128, 127]), the int8 sum exact (float64 here), then
                                           * s_x * s_w (+ bias) in float32
    calibrate(source, prompts)             each linear layer's largest |input| over the prompts in
                                           transformers (a minmax observer: static input scales)
"""

from __future__ import annotations

from pathlib import Path

import torch

LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _args(strategy: str, dynamic: bool, observer: str | None) -> dict:
    return {"actorder": None, "block_structure": None, "dynamic": dynamic, "group_size": None, "num_bits": 8,
            "observer": observer, "observer_kwargs": {}, "scale_dtype": None, "strategy": strategy,
            "symmetric": True, "type": "int", "zp_dtype": None}


def quantization_config(static: bool = False, weights: str = "channel", ignore: tuple[str, ...] = ("lm_head",)
                        ) -> dict:
    """What llm-compressor's save_pretrained writes for scheme W8A8 (static: input activations
    strategy tensor, dynamic false, observed by minmax)."""
    activations = _args("tensor", False, "minmax") if static else _args("token", True, None)
    return {"config_groups": {"group_0": {"format": "int-quantized", "input_activations": activations,
                                          "output_activations": None, "targets": ["Linear"],
                                          "weights": _args(weights, False, "minmax")}},
            "format": "int-quantized", "global_compression_ratio": None, "ignore": list(ignore),
            "kv_cache_scheme": None, "quant_method": "compressed-tensors", "quantization_status": "compressed",
            "sparsity_config": {}, "transform_config": {}, "version": "0.13.0"}


def quantize_weight(w: torch.Tensor, strategy: str = "channel", dtype: torch.dtype = torch.bfloat16
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [N, K], weight_scale [N, 1] (channel) or [1] (tensor) in dtype)."""
    w = w.float()
    amax = w.abs().amax(dim=1, keepdim=True) if strategy == "channel" else w.abs().amax().reshape(1)
    scale = (amax / 127.5).clamp(min=torch.finfo(torch.float32).eps).to(dtype)
    s = scale.float() if strategy == "channel" else scale.float().reshape(1, 1)
    return torch.round(torch.clamp(w / s, -128, 127)).to(torch.int8), scale


def reference_quantize(x: torch.Tensor, input_scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (integer values as float32 [M, K], scales float32 [M, 1])."""
    x = x.float()
    if input_scale is None:
        s = torch.clamp(x.abs().amax(dim=1, keepdim=True), min=1e-12) / 127
        return torch.round(x / s).clamp(-127, 127), s
    s = torch.full((x.shape[0], 1), input_scale, dtype=torch.float32)
    return torch.round(x / s).clamp(-128, 127), s


def reference_linear(x: torch.Tensor, q_w: torch.Tensor, s_w: torch.Tensor, input_scale: float | None = None,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] times the int8 weight q_w [N, K] with float scales s_w (one a row or one for all)
    -> float32 [M, N] (on x's device)."""
    q, s = reference_quantize(x.cpu(), input_scale)
    acc = (q.double().to(x.device) @ q_w.double().t()).float()
    y = acc * s.to(x.device) * s_w.float().reshape(-1).to(x.device)
    return y if bias is None else y + bias.float()


def calibrate(source: Path, prompts: list[list[int]]) -> dict[str, float]:
    """The largest |input| of each linear layer of the model in `source` over the prompts."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32).eval()
    amax: dict[str, float] = {}
    hooks = [m.register_forward_hook(lambda m, args, out, name=name: amax.__setitem__(
        name, max(amax.get(name, 0.0), args[0].abs().max().item())))
        for name, m in hf.named_modules() if name.endswith(LINEAR)]
    with torch.no_grad():
        for ids in prompts:
            hf(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    return amax
