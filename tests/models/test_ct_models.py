"""compressed-tensors weight-only checkpoints (pack-quantized W4A16, W4A16_ASYM, W8A16) written
by the compressed-tensors library itself (tests/ct_checkpoints.py: llm-compressor's presets,
apply_quantization_config, ModelCompressor) from tiny random models saved by transformers, and
loaded by ember with no flag. The reference is transformers on the weights the library's own
dequantizer (CompressedTensorsDequantizer) makes of the checkpoint, in float32; the library's
scales are float32 there, so the weights are exact and every path ember takes is held to
float32 rounding:

- the CPU's default (float32 scales map to no GGUF block: dequantized at load): the
  reference's logits, and its 32 greedy tokens free-running;
- the CUDA kernels (kernels/wna16.py, the GEMV of kernels/gemv.py; zero points where
  asymmetric) run by Triton's interpreter: the reference's logits, its greedy tokens ember's
  argmax at every step (teacher-forced), two decode steps of two sequences through the GEMV free-running;
- a mixture of experts (Qwen3-MoE) whose experts the library quantized one by one: packed in
  FusedMoE through the fused MoE kernels on the interpreter, the same checks.

(W8A8 checkpoints the library writes run in tests/models/test_w8a8_models.py.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import triton_interpreter  # noqa: F401  (the fused MoE kernels' loops on Triton's interpreter)
from family_checks import greedy_tokens, hf_greedy
from int_checkpoints import SIZES, int_gemv_rows

from ember import LLM, SamplingParams
from ember.layers.kernel_paths import gemv_on_cpu
from ember.layers.quant.int_weight import IntWeight

transformers = pytest.importorskip("transformers")
ct_checkpoints = pytest.importorskip("ct_checkpoints")  # needs the compressed-tensors library

pytestmark = pytest.mark.slow  # HF transformers on every model

PROMPTS = [[5, 17, 99, 3, 250, 41, 8, 77, 12, 19, 200, 6, 3], [7],
           [300, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26]]
ENGINE = dict(num_kv_blocks=64, block_size=8, max_model_len=128)


def _save_tiny(model_type: str, tmp_path_factory, **extra) -> Path:
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(model_type, **SIZES, **extra)
    path = tmp_path_factory.mktemp(f"tiny-{model_type}")
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(str(path))
    saved = json.loads((path / "config.json").read_text())
    if "num_local_experts" in saved:  # transformers 5 writes num_local_experts; Qwen's configs say num_experts
        (path / "config.json").write_text(json.dumps(saved | {"num_experts": saved["num_local_experts"]}))
    return path


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    return _save_tiny("llama", tmp_path_factory)


def _checkpoint(base: Path, form: str) -> tuple[Path, Path]:
    path = ct_checkpoints.write_checkpoint(base, base.parent / f"{base.name}-{form}", form)
    return path, ct_checkpoints.dequantize_checkpoint(path)


@pytest.fixture(scope="module")
def llama_form(tiny_llama):
    """form -> (the library's checkpoint of tiny_llama, the reference's greedy tokens, its logits),
    made once a module: the CPU's test and the kernels' test of a form read the same ones."""
    made: dict[str, tuple[Path, list[list[int]], list[torch.Tensor]]] = {}

    def get(form: str) -> tuple[Path, list[list[int]], list[torch.Tensor]]:
        if form not in made:
            path, dequantized = _checkpoint(tiny_llama, form)
            made[form] = (path, *_reference(dequantized))
        return made[form]

    return get


def _reference(dequantized: Path, prompts: list[list[int]] = PROMPTS) -> tuple[list[list[int]], list[torch.Tensor]]:
    """transformers' greedy tokens of the prompts, and its logits over each prompt and its tokens but the last."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(dequantized), dtype=torch.float32).eval()
    greedy = [hf_greedy(hf, ids) for ids in prompts]
    with torch.no_grad():
        logits = [hf(torch.tensor([ids + toks[:-1]])).logits[0] for ids, toks in zip(prompts, greedy)]
    return greedy, logits


def _assert_reference(llm: LLM, greedy: list[list[int]], want: list[torch.Tensor], forward_logits) -> None:
    """Teacher-forced over each prompt and the reference's greedy tokens: its logits within float32
    rounding, and its token ember's argmax at every step."""
    got = forward_logits(llm, [ids + toks[:-1] for ids, toks in zip(PROMPTS, greedy)])
    for ours, ref, ids, toks in zip(got, want, PROMPTS, greedy):
        torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-5)
        assert ours[len(ids) - 1:].argmax(-1).tolist() == toks


@pytest.mark.parametrize("form", ["w4a16-g128", "w4a16-g32", "w4a16-asym-g128", "w8a16-g128", "w8a16-channel"])
def test_library_checkpoint_runs_as_its_dequantized_weights(llama_form, form, forward_logits):
    path, greedy, want = llama_form(form)
    llm = LLM(str(path), **ENGINE)
    assert (llm.config.quantization, llm.config.dtype) == ("compressed-tensors", "float32")
    _assert_reference(llm, greedy, want, forward_logits)
    assert greedy_tokens(llm, PROMPTS) == greedy


@pytest.mark.parametrize("form", ["w4a16-g128", "w4a16-asym-g128"])
def test_the_cuda_kernels_on_the_interpreter_give_the_reference(llama_form, form, forward_logits, monkeypatch):
    path, greedy, want = llama_form(form)
    with gemv_on_cpu():
        llm = LLM(str(path), dtype="float32", **ENGINE)
        qkv = llm.engine.runner.model.model.layers[0].self_attn.qkv_proj.format
        assert isinstance(qkv, IntWeight) and (qkv.tensor.zeros is not None) == ("asym" in form)
        _assert_reference(llm, greedy, want, forward_logits)
        gemv_rows = int_gemv_rows(monkeypatch)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]],  # decode steps of 2 rows: the GEMV's
                            SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert [list(o.outputs[0].token_ids) for o in outs] == [toks[:3] for toks in greedy[:2]]
    assert gemv_rows and set(gemv_rows) == {2}


@pytest.fixture(scope="module")
def tiny_qwen3_moe(tmp_path_factory) -> Path:
    """The tiny Qwen3-MoE both forms quantize, saved once a module."""
    return _save_tiny("qwen3_moe", tmp_path_factory, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128,
                      decoder_sparse_step=1)


@pytest.mark.parametrize("form", ["w4a16-g128", "w4a16-asym-g128"])
def test_moe_experts_the_library_quantized_stay_packed(tiny_qwen3_moe, form, forward_logits):
    """Qwen3-MoE, every expert's projections quantized by the library: FusedMoE holds them packed
    (int32 w13 / w2, zero points where asymmetric) and the fused MoE kernels on the interpreter
    give the reference's logits and greedy tokens."""
    path, dequantized = _checkpoint(tiny_qwen3_moe, form)
    greedy, want = _reference(dequantized, PROMPTS[:2])
    with gemv_on_cpu():
        llm = LLM(str(path), dtype="float32", **ENGINE)
        got = forward_logits(llm, [ids + toks[:-1] for ids, toks in zip(PROMPTS, greedy)])
    symmetric = "asym" not in form
    assert all(layer.mlp.int_experts == (4, 128, symmetric) and layer.mlp.w13.dtype == torch.int32
               for layer in llm.engine.runner.model.model.layers)
    for ours, ref, ids, toks in zip(got, want, PROMPTS, greedy):
        torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-5)
        assert ours[len(ids) - 1:].argmax(-1).tolist() == toks
