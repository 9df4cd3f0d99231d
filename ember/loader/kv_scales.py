"""A checkpoint's calibrated KV-cache scales (compressed-tensors' `kv_cache_scheme`, what
llm-compressor writes for an fp8 KV cache), read into the attention layers' k_scale / v_scale.

    check_kv_cache_scheme(qc, where)   the scheme ember takes: 8-bit float, one static scale
                                       per tensor (per layer); anything else refused by name
    kv_scale_target(name)              a checkpoint tensor's attention-layer scale name, or None

The names: `X.self_attn.k_scale` / `v_scale` (compressed-tensors, ModelOpt, Quark), the older
`X.self_attn.k_proj.output_scale` / `v_proj.output_scale`, and AutoFP8's
`X.self_attn.k_proj.k_scale`. Each is the dequantization multiplier of the fp8 cache: it holds
K / k_scale (kernels/paged.py). The scales take effect with `--kv-cache-dtype fp8`, as in vLLM:
a cache in the model's dtype stores K and V as they are, and needs none.
"""

from __future__ import annotations

from typing import Any

_TAKEN = "ember reads an fp8 KV cache's scales of num_bits 8, type float, strategy tensor, dynamic false, symmetric"
_KEYS = {"num_bits", "type", "symmetric", "strategy", "dynamic", "group_size", "block_structure", "actorder",
         "observer", "observer_kwargs", "scale_dtype", "zp_dtype"}


def check_kv_cache_scheme(qc: dict[str, Any], where: str) -> bool:
    """Whether quantization_config `qc` has a kv_cache_scheme (ValueError for one ember cannot
    run exactly: integer or per-head scales, dynamic ones, zero points, other widths)."""
    kv = qc.get("kv_cache_scheme")
    if not kv:
        return False
    at = f"{where} kv_cache_scheme"
    if not isinstance(kv, dict):
        raise ValueError(f"{at} must be an object, got {type(kv).__name__}")
    if unknown := sorted(set(kv) - _KEYS):
        raise ValueError(f"{at}: keys ember does not read: {', '.join(unknown)}; {_TAKEN}")
    got = (kv.get("num_bits"), kv.get("type"), kv.get("strategy", "tensor"), bool(kv.get("dynamic", False)),
           kv.get("symmetric", True))
    if got != (8, "float", "tensor", False, True):
        raise ValueError(f"{at}: num_bits {got[0]}, type {got[1]!r}, strategy {got[2]!r}, dynamic {got[3]}, "
                         f"symmetric {got[4]} is not supported; {_TAKEN} (per-head 'attn_head' scales and "
                         "integer KV caches are not)")
    return True


def kv_scale_target(name: str) -> str | None:
    """`...self_attn.k_scale` for a checkpoint's K-cache scale (either name), likewise V; None
    for any other tensor."""
    module, _, leaf = name.rpartition(".")
    parent, _, proj = module.rpartition(".")
    if leaf in ("k_scale", "v_scale"):
        return f"{parent}.{leaf}" if proj in ("k_proj", "v_proj") else name  # AutoFP8's X.k_proj.k_scale
    if leaf == "output_scale" and proj in ("k_proj", "v_proj"):
        return f"{parent}.{proj[0]}_scale"
    return None
