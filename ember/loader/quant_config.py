"""config.json's `quantization_config` -> the scheme whose reader pairs the checkpoint's
tensors: FP8 (loader/fp8_checkpoint.py) or integer weights (loader/int_checkpoint.py).

    quant_method            reader
    fp8                     fp8_checkpoint
    compressed-tensors      fp8_checkpoint for float-quantized / naive-quantized (fp8 values),
                            int_checkpoint for pack-quantized (int4 / int8 weights) and
                            int-quantized (int8 weights: W8A8, or weight-only)
    awq, gptq               int_checkpoint
    mxfp4                   none here: gpt-oss's experts, decoded where they load (loader/weights.py)
    compressed-tensors      none when it quantizes only the KV cache (no config_groups, a
                            kv_cache_scheme): dense weights and the KV scales (loader/kv_scales.py)

Anything else is refused with a ValueError naming it.
"""

from __future__ import annotations

from typing import Any

from ember.loader.fp8_checkpoint import FP8Scheme, fp8_scheme
from ember.loader.int_checkpoint import CT_FORMATS, IntScheme, int_scheme
from ember.loader.kv_scales import check_kv_cache_scheme

SUPPORTED = ("ember loads quant_method 'fp8' (e4m3, scales per tensor or per 128 x 128 block), 'awq' (4-bit GEMM "
             "packing), 'gptq' (4 and 8 bits) and 'compressed-tensors' (fp8 float-quantized, int pack-quantized "
             "weight-only, int-quantized W8A8)")


def checkpoint_scheme(config: dict[str, Any], source: str = "config.json") -> FP8Scheme | IntScheme | None:
    """The checkpoint's quantization scheme from config.json; None when it has no quantization_config."""
    qc = config.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ValueError(f"{source}: quantization_config must be an object, got {type(qc).__name__}")
    method = qc.get("quant_method")
    if method == "compressed-tensors" and not qc.get("config_groups") and check_kv_cache_scheme(qc, source):
        return None  # llm-compressor's KV-cache-only recipe: dense weights, the KV scales (loader/kv_scales.py)
    if method in ("awq", "gptq") or (method == "compressed-tensors" and qc.get("format") in CT_FORMATS):
        return int_scheme(qc, source)
    if method in ("fp8", "compressed-tensors"):
        return fp8_scheme(qc, source)
    if method == "mxfp4":  # gpt-oss's experts: decoded as they load (loader/weights.py), the rest is dense
        return None
    raise ValueError(f"{source}: quant_method {method!r} is not supported; {SUPPORTED}. Use one of those, an "
                     "unquantized (bf16) checkpoint of the model, or a GGUF file")
