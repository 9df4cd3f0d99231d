"""A compressed-tensors checkpoint's calibrated fp8 KV-cache scales (`kv_cache_scheme`, what
llm-compressor writes), read into the attention layers and used by `--kv-cache-dtype fp8`.

The checkpoint: a tiny random Llama saved by transformers, its K / V calibrated as
llm-compressor's static minmax observer does (the largest |K| and |V| each layer sees over the
prompts, after RoPE, through compressed-tensors' calculate_qparams), config.json's
quantization_config written by the library (ModelCompressor.update_config: no config groups,
the kv_cache_scheme). The reference is transformers with an attention function that rounds K
and V through float8_e4m3fn at those scales, as an fp8 cache holding K / k_scale does.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from int_checkpoints import SIZES

from ember import LLM

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors import ModelCompressor  # noqa: E402
from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationStatus  # noqa: E402
from compressed_tensors.quantization.utils import calculate_qparams  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import AttentionInterface  # noqa: E402
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402

FP8 = torch.float8_e4m3fn
PROMPTS = [[5, 17, 99, 3, 250, 41, 8, 77, 12, 19, 200, 6, 3], [7, 8, 9], list(range(300, 330))]
KV_SCHEME = QuantizationArgs(num_bits=8, type="float", strategy="tensor", dynamic=False, symmetric=True)
ENGINE = dict(dtype="float32", num_kv_blocks=64, block_size=8, max_model_len=128)

_scales: dict[int, tuple[float, float]] = {}  # the fp8 reference's scales, a layer's (k, v)
_amax: dict[int, tuple[float, float]] = {}  # calibration: the largest |K|, |V| each layer saw


def _calibrate(module, q, k, v, mask, **kw):
    a = _amax.get(module.layer_idx, (0.0, 0.0))
    _amax[module.layer_idx] = (max(a[0], k.abs().max().item()), max(a[1], v.abs().max().item()))
    return sdpa_attention_forward(module, q, k, v, mask, **kw)


def _fp8_cache(module, q, k, v, mask, **kw):
    ks, vs = _scales[module.layer_idx]

    def rounded(x: torch.Tensor, s: float) -> torch.Tensor:
        return (x / s).clamp(-448, 448).to(FP8).float() * s

    return sdpa_attention_forward(module, q, rounded(k, ks), rounded(v, vs), mask, **kw)


AttentionInterface.register("ember_calibrate", _calibrate)
AttentionInterface.register("ember_fp8_cache", _fp8_cache)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(transformers' model, its directory, the calibrated {layer: (k_scale, v_scale)})."""
    torch.manual_seed(0)
    base = tmp_path_factory.mktemp("tiny-llama-kv")
    transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model("llama", **SIZES)).save_pretrained(
        str(base))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32,
                                                           attn_implementation="ember_calibrate").eval()
    _amax.clear()
    with torch.no_grad():
        for ids in PROMPTS:
            hf(torch.tensor([ids]))
    scales = {}
    for layer, amaxes in _amax.items():
        scales[layer] = tuple(calculate_qparams(torch.tensor([-a]), torch.tensor([a]), KV_SCHEME)[0].item()
                              for a in amaxes)
    return hf, base, scales


def _write(base: Path, out: Path, scales: dict[int, tuple[float, float]], old_names: bool = False,
           kv_scheme: QuantizationArgs = KV_SCHEME) -> Path:
    """`base` with the scales under llm-compressor's names (old_names: k_proj.output_scale, its
    earlier form) and the quantization_config the library writes for a KV-cache-only recipe."""
    shutil.copytree(base, out)
    tensors = load_file(str(base / "model.safetensors"))
    for layer, pair in scales.items():
        for kind, value in zip("kv", pair):
            leaf = f"{kind}_proj.output_scale" if old_names else f"{kind}_scale"
            tensors[f"model.layers.{layer}.self_attn.{leaf}"] = torch.tensor([value])
    save_file(tensors, str(out / "model.safetensors"))
    config = QuantizationConfig(config_groups={}, kv_cache_scheme=kv_scheme,
                                quantization_status=QuantizationStatus.COMPRESSED)
    ModelCompressor(quantization_config=config).update_config(str(out))
    return out


def _reference(hf, scales: dict[int, tuple[float, float]] | None) -> list[torch.Tensor]:
    """transformers' logits over PROMPTS with K / V rounded through fp8 at `scales` (None: as they are)."""
    _scales.clear()
    _scales.update(scales or {})
    hf.set_attn_implementation("ember_fp8_cache" if scales else "sdpa")
    with torch.no_grad():
        return [hf(torch.tensor([ids])).logits[0] for ids in PROMPTS]


@pytest.mark.parametrize("old_names", [False, True], ids=["k_scale", "k_proj.output_scale"])
def test_an_fp8_cache_takes_the_checkpoints_scales(model, tmp_path, forward_logits, old_names):
    hf, base, scales = model
    path = _write(base, tmp_path / "kv", scales, old_names)
    assert json.loads((path / "config.json").read_text())["quantization_config"]["kv_cache_scheme"]["type"] == "float"
    llm = LLM(str(path), kv_cache_dtype="fp8", **ENGINE)
    layers = llm.engine.runner.model.attention_layers()
    assert [(a.k_scale.item(), a.v_scale.item()) for a in layers] == [scales[i] for i in range(len(layers))]
    got = forward_logits(llm, PROMPTS)
    for ours, ref, unit in zip(got, _reference(hf, scales), _reference(hf, {i: (1.0, 1.0) for i in scales})):
        torch.testing.assert_close(ours, ref, rtol=0, atol=2e-5)  # measured <= 2.7e-6
        assert (ours - unit).abs().max() > 0.02  # at scale 1.0 small K / V fall in fp8's subnormals: 0.04-0.07


def test_a_cache_in_the_model_dtype_needs_no_scales(model, tmp_path, forward_logits):
    hf, base, scales = model
    llm = LLM(str(_write(base, tmp_path / "kv", scales)), **ENGINE)
    assert llm.engine.runner.kv_cache.dtype == torch.float32
    for ours, ref in zip(forward_logits(llm, PROMPTS), _reference(hf, None)):
        torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-5)


def test_scales_ember_cannot_use_are_refused(model, tmp_path):
    _, base, scales = model
    per_head = QuantizationArgs(num_bits=8, type="float", strategy="attn_head", dynamic=False, symmetric=True)
    with pytest.raises(ValueError, match=r"kv_cache_scheme: num_bits 8, type 'float', strategy 'attn_head'.*per-head"):
        LLM(str(_write(base, tmp_path / "per-head", scales, kv_scheme=per_head)), **ENGINE)
    with pytest.raises(ValueError, match=r"KV-cache scales for some attention layers only: no "
                                         r"model\.layers\.1\.self_attn\.k_scale, model\.layers\.1\.self_attn\.v_scale"):
        LLM(str(_write(base, tmp_path / "one-layer", {0: scales[0]})), kv_cache_dtype="fp8", **ENGINE)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.k_scale must be one positive number"):
        LLM(str(_write(base, tmp_path / "zero", {0: (0.0, 1.0), 1: scales[1]})), kv_cache_dtype="fp8", **ENGINE)
