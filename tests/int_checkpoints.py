"""Integer-weight checkpoints made here, as the formats' own tools write them (AutoAWQ and
GPTQModel need CUDA; llm-compressor would move torch), and read back by each format's
published reference code, written here from the published layouts and independent of
ember's readers:

    pack_awq / awq_reference          AutoAWQ's WQLinear_GEMM.from_linear packing (qweight
                                      [K, N/8], nibbles in the order 0 2 4 6 1 3 5 7) and its
                                      dequantize_gemm (unpack_awq, reverse_awq_order)
    pack_gptq / gptq_reference        AutoGPTQ / GPTQModel's pack (qweight [K/per, N] along K,
                                      qzeros along N; the v1 format stores each zero one less)
                                      and their dequantize_weight (scales[g_idx] * (w - z[g_idx]))
    pack_ct / ct_reference            compressed-tensors' own pack_to_int32 / unpack_from_int32
                                      (the library's functions: value + 2^(bits - 1), along K,
                                      padded) and its group dequantization; whole checkpoints
                                      the library writes itself (tests/ct_checkpoints.py), but
                                      act-order groups (actorder "group", a weight_g_idx), which
                                      the library no longer writes and older checkpoints hold

`Quantized` is what a quantizer decided (the integers, scales and zeros a row of groups); its
`dequantized()` is the reference weight every format must reproduce exactly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
AWQ_UNPACK_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]


@dataclass
class Quantized:
    """W [N, K] = (q - zeros[:, g_idx]) * scales[:, g_idx]: q uint8 [N, K], scales float16 /
    bfloat16 [N, G], zeros int [N, G], g_idx int [K]."""

    q: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    g_idx: torch.Tensor
    bits: int
    group_size: int

    def dequantized(self) -> torch.Tensor:
        g = self.g_idx.long()
        return (self.q.float() - self.zeros.float()[:, g]) * self.scales.float()[:, g]


def quantize(w: torch.Tensor, bits: int, group_size: int, symmetric: bool, act_order: bool = False,
             scale_dtype: torch.dtype = torch.float16, seed: int = 0) -> Quantized:
    """Round to nearest in groups (GPTQ's sym / asym ranges); act_order: columns go to groups
    in a random order (as desc_act sorts them by the Hessian), g_idx says which."""
    n, k = w.shape
    gs = k if group_size == -1 else group_size
    order = torch.randperm(k, generator=torch.Generator().manual_seed(seed)) if act_order else torch.arange(k)
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[order] = (torch.arange(k) // gs).to(torch.int32)
    groups = -(-k // gs)
    top = 2 ** bits - 1
    scales = torch.empty(n, groups)
    zeros = torch.empty(n, groups, dtype=torch.int32)
    for g in range(groups):
        cols = w[:, g_idx == g]
        if symmetric:
            scales[:, g] = cols.abs().amax(1) / (top / 2)
            zeros[:, g] = 2 ** (bits - 1)
        else:
            low, high = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
            scales[:, g] = (high - low) / top
            zeros[:, g] = torch.round(-low / scales[:, g]).to(torch.int32)
    scales = scales.clamp(min=1e-6).to(scale_dtype)
    g = g_idx.long()
    q = torch.round(w / scales.float()[:, g]) + zeros[:, g]
    return Quantized(q.clamp(0, top).to(torch.uint8), scales, zeros, g_idx, bits, group_size)


def _words(values: np.ndarray, bits: int, axis: int, order: list[int] | None = None) -> torch.Tensor:
    """uint values packed 32 / bits a word along `axis` (value i of a word at bits i * bits,
    value i being the word's `order[i]`-th along the axis), as int32."""
    per = 32 // bits
    v = np.moveaxis(values.astype(np.uint32), axis, -1)
    pad = -v.shape[-1] % per
    v = np.pad(v, [(0, 0)] * (v.ndim - 1) + [(0, pad)])
    v = v.reshape(*v.shape[:-1], -1, per)
    if order is not None:
        v = v[..., order]
    packed = np.zeros(v.shape[:-1], dtype=np.uint32)
    for i in range(per):
        packed |= v[..., i] << np.uint32(bits * i)
    return torch.from_numpy(np.ascontiguousarray(np.moveaxis(packed, -1, axis)).view(np.int32))


# -- AWQ (AutoAWQ, version gemm) ----------------------------------------------------------------------------------


def pack_awq(qz: Quantized) -> dict[str, torch.Tensor]:
    """qweight [K, N/8], qzeros [G, N/8] (column 8c + AWQ_PACK_ORDER[i] at bits 4i), scales [G, N] float16."""
    assert qz.bits == 4 and torch.equal(qz.g_idx.long(), torch.arange(qz.q.shape[1]) // (qz.group_size
                                        if qz.group_size > 0 else qz.q.shape[1]))
    return {"qweight": _words(qz.q.t().numpy(), 4, 1, AWQ_PACK_ORDER),
            "qzeros": _words(qz.zeros.t().numpy(), 4, 1, AWQ_PACK_ORDER),
            "scales": qz.scales.t().contiguous().half()}


def awq_reference(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """AutoAWQ's dequantize_gemm: unpack each word's 8 nibbles, undo the interleave, (q - z) * s; [N, K]."""
    shifts = torch.arange(0, 32, 4)
    iw = torch.bitwise_right_shift(qweight[:, :, None], shifts[None, None, :]).view(qweight.shape[0], -1)
    iz = torch.bitwise_right_shift(qzeros[:, :, None], shifts[None, None, :]).view(qzeros.shape[0], -1)
    reverse = torch.arange(iz.shape[-1]).view(-1, 8)[:, AWQ_UNPACK_ORDER].view(-1)
    iw, iz = iw[:, reverse] & 15, iz[:, reverse] & 15
    gs = qweight.shape[0] if group_size == -1 else group_size
    w = (iw - iz.repeat_interleave(gs, 0)).float() * scales.float().repeat_interleave(gs, 0)
    return w.t()


# -- GPTQ (AutoGPTQ / GPTQModel) -----------------------------------------------------------------------------------


def pack_gptq(qz: Quantized, v1: bool) -> dict[str, torch.Tensor]:
    """qweight [K / per, N] (row per * r + i at bits i * bits), qzeros [G, N / per] (v1: each
    zero minus one), scales [G, N] float16, g_idx [K]."""
    zeros = qz.zeros.t().numpy().astype(np.int64) - (1 if v1 else 0)
    assert zeros.min() >= 0, "the v1 format cannot store a zero of 0"
    return {"qweight": _words(qz.q.t().numpy(), qz.bits, 0), "qzeros": _words(zeros, qz.bits, 1),
            "scales": qz.scales.t().contiguous().half(), "g_idx": qz.g_idx.clone()}


def gptq_reference(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor, bits: int,
                   v1: bool) -> torch.Tensor:
    """dequantize_weight: shift each word's values out along K (weight) and N (zeros), mask,
    v1's zeros + 1, scales[g_idx] * (weight - zeros[g_idx]); [N, K]."""
    per, top = 32 // bits, 2 ** bits - 1
    wf = torch.arange(0, 32, bits, dtype=torch.int32)
    zeros = torch.bitwise_right_shift(qzeros.unsqueeze(2).expand(-1, -1, per), wf.unsqueeze(0)) & top
    zeros = zeros.reshape(scales.shape) + (1 if v1 else 0)
    weight = torch.bitwise_right_shift(qweight.unsqueeze(1).expand(-1, per, -1), wf.unsqueeze(-1)) & top
    weight = weight.reshape(-1, weight.shape[2])
    g = g_idx.long()
    return (scales.float()[g] * (weight - zeros[g]).float()).t()


# -- compressed-tensors pack-quantized -----------------------------------------------------------------------------


def pack_ct(qz: Quantized) -> dict[str, torch.Tensor]:
    """weight_packed [N, ceil(K / per)] (the signed value + 2^(bits - 1), along K), weight_scale
    [N, G], weight_shape [N, K]; act-order: weight_g_idx; asymmetric: weight_zero_point [ceil(N /
    per), G] (the signed zeros packed along N)."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    half = 2 ** (qz.bits - 1)
    signed = (qz.q.to(torch.int16) - half).to(torch.int8)  # what the quantizer gives the packer
    out = {"weight_packed": pack_to_int32(signed, qz.bits), "weight_scale": qz.scales.clone(),
           "weight_shape": torch.tensor(list(qz.q.shape))}
    if bool((qz.zeros != half).any()):
        out["weight_zero_point"] = pack_to_int32((qz.zeros - half).to(torch.int8), qz.bits, packed_dim=0)
    k = qz.q.shape[1]
    if not torch.equal(qz.g_idx.long(), torch.arange(k) // (k if qz.group_size == -1 else qz.group_size)):
        out["weight_g_idx"] = qz.g_idx.clone()
    return out


def ct_reference(packed: torch.Tensor, scale: torch.Tensor, shape: torch.Tensor, bits: int,
                 g_idx: torch.Tensor | None, group_size: int, zero_point: torch.Tensor | None = None) -> torch.Tensor:
    """The library's unpack_from_int32 (cut to the shape, minus the offset; the zero points
    alike, along N), then (value - zero) times each column's group scale; [N, K]."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    signed = unpack_from_int32(packed, bits, torch.Size(shape.tolist())).float()
    k = signed.shape[1]
    g = g_idx.long() if g_idx is not None else torch.arange(k) // (k if group_size == -1 else group_size)
    if zero_point is not None:
        signed -= unpack_from_int32(zero_point, bits, scale.shape, packed_dim=0).float()[:, g]
    return signed * scale.float()[:, g]


# -- checkpoints ---------------------------------------------------------------------------------------------------

# the projections quantized: Llama's and the Qwen MoEs' (their experts' too), Mixtral's experts' w1 (gate), w3 (up), w2
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "w1", "w3", "w2")
# the forms the tests write: name -> (method, bits, group size, symmetric, act-order, GPTQ v1)
FORMS = {
    "awq-g128": ("awq", 4, 128, False, False, False),
    "awq-g32": ("awq", 4, 32, False, False, False),
    "gptq-int4-g128": ("gptq", 4, 128, True, False, True),  # the common Qwen / TheBloke form
    "gptq-int4-asym-g32": ("gptq", 4, 32, False, False, True),
    "gptq-int4-asym-actorder-g64-v2": ("gptq", 4, 64, False, True, False),
    "gptq-int8-channel": ("gptq", 8, -1, True, False, True),
    "gptq-int8-asym-g128-v2": ("gptq", 8, 128, False, False, False),  # no GGUF block: dequantized on the CPU
    # the library writes the others itself (ct_checkpoints.py), not act-order groups any more
    "ct-w4a16-actorder-g64": ("compressed-tensors", 4, 64, True, True, False),
}
# the tiny models' sizes (transformers' config keys): every group size divides 256 and 384
SIZES = dict(vocab_size=512, hidden_size=256, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, max_position_embeddings=256, tie_word_embeddings=False,
             bos_token_id=1, eos_token_id=2)




def quantization_config(method: str, bits: int, group_size: int, symmetric: bool, act_order: bool,
                        v1: bool = True) -> dict:
    """config.json's quantization_config as each tool writes it."""
    if method == "awq":  # AutoAWQ's save_quantized
        return {"quant_method": "awq", "zero_point": True, "group_size": group_size, "bits": 4, "version": "gemm",
                "modules_to_not_convert": None}
    if method == "gptq":  # GPTQModel's
        return {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": act_order,
                "sym": symmetric, "lm_head": False, "damp_percent": 0.01, "static_groups": False,
                "true_sequential": True, "checkpoint_format": "gptq" if v1 else "gptq_v2", "pack_dtype": "int32",
                "meta": {"quantizer": ["gptqmodel:2.2.0"], "uri": "https://github.com/modelcloud/gptqmodel"}}
    weights = {"num_bits": bits, "type": "int", "symmetric": True, "dynamic": False, "observer": "minmax",
               "observer_kwargs": {}, "block_structure": None,
               "strategy": "channel" if group_size == -1 else "group",
               "group_size": None if group_size == -1 else group_size, "actorder": "group" if act_order else None}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                          "output_activations": None}},
            "ignore": ["lm_head"], "kv_cache_scheme": None, "sparsity_config": {}, "transform_config": {},
            "global_compression_ratio": None, "version": "0.11.0"}


def write_checkpoint(source: Path, out: Path, method: str, bits: int, group_size: int, symmetric: bool = True,
                     act_order: bool = False, v1: bool = True) -> tuple[Path, Path]:
    """The model in `source` (config.json + model.safetensors saved by transformers) with every
    linear layer but the LM head quantized and packed as `method` writes it, in `out`; and its
    dequantized weights as a plain float32 checkpoint in `out`-dequantized. Returns both."""
    from safetensors.torch import load_file

    tensors = load_file(str(source / "model.safetensors"))
    config = json.loads((source / "config.json").read_text())
    packed, dense = {}, {}
    for name, t in sorted(tensors.items()):
        module, _, leaf = name.rpartition(".")
        if leaf != "weight" or not module.endswith(LINEAR):
            packed[name] = dense[name] = t.float()
            continue
        # act-order: one column order an input, as GPTQ finds for q, k and v (gate and up) from one Hessian
        seed = sum(map(ord, module.rsplit(".", 1)[0])) + LINEAR.index(module.rsplit(".", 1)[1]) // 3 * 7
        qz = quantize(t.float(), bits, group_size, symmetric, act_order,
                      torch.bfloat16 if method == "compressed-tensors" else torch.float16, seed=seed)
        dense[name] = qz.dequantized()
        parts = {"awq": pack_awq, "gptq": lambda q: pack_gptq(q, v1), "compressed-tensors": pack_ct}[method](qz)
        packed |= {f"{module}.{part}": value for part, value in parts.items()}
    qdir, ddir = out, out.parent / f"{out.name}-dequantized"
    for path, weights, cfg in [(qdir, packed, config | {"quantization_config": quantization_config(
            method, bits, group_size, symmetric, act_order, v1)}), (ddir, dense, config)]:
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text(json.dumps(cfg))
        save_file({n: t.contiguous() for n, t in weights.items()}, str(path / "model.safetensors"))
    return qdir, ddir


def int_gemv_rows(monkeypatch) -> list[int]:
    """The row count of each call of kernels/int_gemv.py's GEMV from here on (the integer layers
    import it at each call): which steps the GEMV ran, not the tensor-core matmul."""
    import ember.kernels.int_gemv as module

    rows: list[int] = []
    real = module.int_gemv

    def counted(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        rows.append(x.shape[0])
        return real(x, *args, **kwargs)

    monkeypatch.setattr(module, "int_gemv", counted)
    return rows
