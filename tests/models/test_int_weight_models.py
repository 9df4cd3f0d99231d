"""AWQ, GPTQ and compressed-tensors pack-quantized act-order checkpoints of tiny random Llama
and Qwen3 models saved by transformers, quantized and packed here as each tool writes them
(the compressed-tensors library writes the other compressed-tensors forms: test_ct_models.py)
(tests/int_checkpoints.py, whose unpacking the formats' reference code reads back:
tests/layers/test_int_weights.py), with config.json's quantization_config as the tools write
it. The reference is transformers on the dequantized weights in float32. Three ways ember
runs them:

- the CPU's default (GGUF blocks, activations quantized to int8 per 32 values as llama.cpp
  does): logits within BLOCKS_BOUND of the reference's largest logit (measured at most
  1.1 % on Llama, 1.5 % on Qwen3 over every form), and teacher-forced agreement with the reference's
  greedy tokens wherever its top-2 margin exceeds twice the measured error. Free-running greedy
  tokens of a random model part from an int8-activation path at the first near-tie (top-2
  margins down to 1e-4 here, logit errors ~1e-2), so they are compared on the exact paths:
- quantization='none' (dequantized at load): logits within float32 rounding, 32 greedy
  tokens equal;
- the CUDA kernels (kernels/wna16.py, the GEMV of kernels/gemv.py) run by Triton's
  interpreter in float32: logits within float32 rounding, and the reference's 32 greedy
  tokens are ember's argmax at every step (teacher-forced: one prefill over each prompt and
  those tokens, which is the greedy run exactly); three decode steps through the GEMV
  free-running.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
import triton_interpreter  # noqa: F401  (the fused MoE kernels' loops on Triton's interpreter)
from family_checks import greedy_tokens, hf_greedy
from int_checkpoints import FORMS, SIZES, int_gemv_rows, write_checkpoint

from ember import LLM, SamplingParams
from ember.layers.kernel_paths import gemv_on_cpu
from ember.layers.quant import model_weight_bytes
from ember.layers.quant.gguf_blocks import GGUFBlocks
from ember.layers.quant.int_weight import IntWeight

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow  # HF transformers on every model

PROMPTS = [[5, 17, 99, 3, 250, 41, 8, 77, 12, 19, 200, 6, 3], [7],
           [300, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26]]
ENGINE = dict(num_kv_blocks=64, block_size=8, max_model_len=128)
BLOCKS_BOUND = 0.02  # the CPU blocks path's max |logit error| over the reference's max |logit|; measured <= 0.0153
KERNEL_FORMS = ["awq-g128", "gptq-int4-asym-actorder-g64-v2", "gptq-int8-channel"]  # compressed-tensors': test_ct_models


def _save_tiny(model_type: str, tmp_path_factory) -> Path:
    """A tiny random model saved by transformers (float32 safetensors)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(model_type, **SIZES))
    path = tmp_path_factory.mktemp(f"tiny-{model_type}")
    model.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    return _save_tiny("llama", tmp_path_factory)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def base_model(request, tmp_path_factory) -> Path:
    """Llama, and Qwen3 (q/k norms, unquantized)."""
    return request.getfixturevalue("tiny_llama") if request.param == "llama" else _save_tiny("qwen3", tmp_path_factory)


def _checkpoint(base: Path, form: str) -> tuple[Path, Path]:
    method, bits, group, symmetric, act, v1 = FORMS[form]
    return write_checkpoint(base, base.parent / f"{base.name}-{form}", method, bits, group, symmetric, act, v1)


def _reference(dequantized: Path, prompts: list[list[int]] = PROMPTS) -> tuple[list[list[int]], list[torch.Tensor]]:
    """transformers' greedy tokens of the prompts, and its logits over each prompt and its tokens but the last."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(dequantized), dtype=torch.float32).eval()
    greedy = [hf_greedy(hf, ids) for ids in prompts]
    with torch.no_grad():
        logits = [hf(torch.tensor([ids + toks[:-1]])).logits[0] for ids, toks in zip(prompts, greedy)]
    return greedy, logits


@pytest.fixture(scope="module")
def made():
    """(base, form) -> (checkpoint, the reference's greedy tokens, its logits), made once a module:
    the CPU's test, the kernels' test and the GEMV's test of a form read the same ones."""
    cache: dict[tuple[Path, str], tuple[Path, list[list[int]], list[torch.Tensor]]] = {}

    def get(base: Path, form: str) -> tuple[Path, list[list[int]], list[torch.Tensor]]:
        if (base, form) not in cache:
            path, dequantized = _checkpoint(base, form)
            cache[base, form] = (path, *_reference(dequantized))
        return cache[base, form]

    return get


def _teacher_forced(llm: LLM, greedy: list[list[int]], forward_logits) -> list[torch.Tensor]:
    """Each prompt (the first len(greedy) of PROMPTS) and its greedy tokens but the last, one forward."""
    return forward_logits(llm, [ids + toks[:-1] for ids, toks in zip(PROMPTS, greedy)])


@pytest.mark.parametrize("form", sorted(FORMS))
def test_checkpoint_runs_as_its_dequantized_weights(base_model, made, form, forward_logits):
    path, greedy, want = made(base_model, form)
    # the CPU's default: the integer weights as GGUF blocks, int8 activations
    llm = LLM(str(path), **ENGINE)
    assert (llm.config.quantization, llm.config.dtype) == (FORMS[form][0], "float32")
    errors = []
    for got, ref, ids, toks in zip(_teacher_forced(llm, greedy, forward_logits), want, PROMPTS, greedy):
        error = (got - ref).abs().max()
        errors.append(float(error / ref.abs().max()))
        top2 = ref[len(ids) - 1:].topk(2).values
        decided = (top2[:, 0] - top2[:, 1]) > 2 * error
        assert torch.equal(got[len(ids) - 1:].argmax(-1)[decided], torch.tensor(toks)[decided])
    assert max(errors) <= BLOCKS_BOUND, errors
    # dequantized at load: float32 rounding, and the same greedy tokens
    exact = LLM(str(path), quantization="none", dtype="float32", **ENGINE)
    for got, ref in zip(_teacher_forced(exact, greedy, forward_logits), want):
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)
    assert greedy_tokens(exact, PROMPTS) == greedy


@pytest.mark.parametrize("form", KERNEL_FORMS)
def test_the_cuda_kernels_on_the_interpreter_give_the_reference_greedy_tokens(tiny_llama, made, form,
                                                                             forward_logits):
    """One prefill of each prompt and its 32 reference greedy tokens through kernels/wna16.py:
    ember's argmax at every step is the reference's token."""
    path, greedy, want = made(tiny_llama, form)
    with gemv_on_cpu():
        llm = LLM(str(path), dtype="float32", **ENGINE)
        assert isinstance(llm.engine.runner.model.model.layers[0].self_attn.qkv_proj.format, IntWeight)
        logits = _teacher_forced(llm, greedy, forward_logits)
    for got, ref, ids, toks in zip(logits, want, PROMPTS, greedy):
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)
        assert got[len(ids) - 1:].argmax(-1).tolist() == toks


@pytest.mark.parametrize("form", ["gptq-int4-asym-actorder-g64-v2", "awq-g128"])
def test_decode_steps_through_the_gemv_kernel(tiny_llama, made, form, monkeypatch):
    """Two greedy decode steps of two sequences (the GEMV's rows): int_gemv.py's word GEMV with its norm and
    SiLU prologues, over AWQ's groups and over act-order weights (a g_idx per column) sorted by
    group at load, x read through the order."""
    from ember.kernels.int_gemv import words_kernel_takes

    path, greedy, _ = made(tiny_llama, form)
    with gemv_on_cpu():
        llm = LLM(str(path), dtype="float32", **ENGINE)
        layer = llm.engine.runner.model.model.layers[0].mlp.down_proj.format
        t = layer.tensor
        assert words_kernel_takes(t.bits, t.group_size, t.in_features, t.g_idx)
        assert (layer.order is not None) == ("actorder" in form)
        gemv_rows = int_gemv_rows(monkeypatch)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]],
                            SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert [list(o.outputs[0].token_ids) for o in outs] == [toks[:3] for toks in greedy[:2]]
    assert gemv_rows and set(gemv_rows) == {2}


def _save_tiny_moe(family: str, tmp_path_factory) -> Path:
    """A tiny random mixture of experts saved by transformers: Mixtral or Qwen3-MoE, 8 experts of
    intermediate 128, top-2, every layer sparse."""
    torch.manual_seed(0)
    if family == "mixtral":
        config = transformers.AutoConfig.for_model("mixtral", **(SIZES | {"intermediate_size": 128}),
                                                   num_local_experts=8, num_experts_per_tok=2)
    else:
        config = transformers.AutoConfig.for_model("qwen3_moe", **SIZES, num_experts=8, num_experts_per_tok=2,
                                                   moe_intermediate_size=128, decoder_sparse_step=1)
    base = tmp_path_factory.mktemp(f"tiny-{family}")
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(str(base))
    if family == "qwen3_moe":  # transformers 5 writes num_local_experts; Qwen's configs say num_experts
        saved = json.loads((base / "config.json").read_text())
        (base / "config.json").write_text(json.dumps(saved | {"num_experts": saved["num_local_experts"]}))
    return base


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    """family -> its tiny model (_save_tiny_moe), saved once."""
    saved: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in saved:
            saved[family] = _save_tiny_moe(family, tmp_path_factory)
        return saved[family]

    return get


@pytest.mark.parametrize("family,form", [("mixtral", "awq-g128"), ("qwen3_moe", "gptq-int4-g128")])
def test_moe_experts_stay_packed_through_the_fused_kernels(tiny_moe, family, form, forward_logits):
    """Where the fused MoE kernels run (Triton's interpreter here, in float32), a mixture of
    experts' integer experts load packed with no flag (Mixtral as AWQ: 4 bits with zero points;
    Qwen3-MoE as GPTQ: 4 bits symmetric, v1 zeros): FusedMoE holds int32 w13 / w2 with their
    scales and zeros, the bytes the format packs (the model's weights no more than the file's
    tensors), and the reference's logits (transformers on the dequantized weights) come out
    within float32 rounding, its 32 greedy tokens ember's argmax at every step (one prefill
    over each prompt and those tokens), and three free-running decode steps of one sequence
    through the fused GEMV (two pairs among eight experts) equal its first three."""
    method, bits, group, symmetric, _, _ = FORMS[form]
    path, dequantized = _checkpoint(tiny_moe(family), form)
    greedy, want = _reference(dequantized, PROMPTS[:2])
    with gemv_on_cpu():
        llm = LLM(str(path), dtype="float32", **ENGINE)
        model = llm.engine.runner.model
        logits = _teacher_forced(llm, greedy, forward_logits)
        decode = llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(temperature=0, max_tokens=3,
                                                                                  ignore_eos=True))
    assert llm.config.quantization == method
    layers = [layer.mlp for layer in model.model.layers]
    assert all(m.int_experts == (bits, group, symmetric) and m.w13.dtype == torch.int32 for m in layers)
    hidden, inter, experts = 256, 128, 8
    scale_bytes = 2 + (not symmetric)  # a float16 scale and a uint8 zero point a group
    packed = experts * sum(rows * (cols * bits // 32 * 4 + cols // group * scale_bytes)
                           for rows, cols in ((2 * inter, hidden), (hidden, inter)))
    assert all(sum(p.nbytes for n, p in m.named_parameters() if n.startswith(("w13", "w2"))) == packed for m in layers)
    assert model_weight_bytes(model) == llm.engine.runner.weight_bytes <= llm.engine.runner.file_tensor_bytes
    for got, ref, ids, toks in zip(logits, want, PROMPTS, greedy):
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)
        assert got[len(ids) - 1:].argmax(-1).tolist() == toks
    assert list(decode[0].outputs[0].token_ids) == greedy[0][:3]


def test_quantized_experts_are_dequantized_at_load_on_the_cpu(tiny_moe, caplog):
    """A GPTQ mixture of experts (Qwen3-MoE) on the CPU: FusedMoE's torch path multiplies dense
    experts (GGUF ones too), so the stacked experts load dequantized (logged with the reason:
    their values are exactly the checkpoint's) beside the attention kept as GGUF blocks; the
    router is not quantized. (Their logits are not compared: a router's near-tie parts an
    int8-activation path from the reference by a whole expert, and the dense experts'
    arithmetic is tests/models/test_moe.py's.)"""
    from safetensors.torch import load_file

    base = tiny_moe("qwen3_moe")  # the fused kernels' test's model, saved once
    path, dequantized = write_checkpoint(base, base.parent / "tiny-qwen3-moe-gptq", "gptq", 4, 64)
    with caplog.at_level(logging.INFO, logger="ember.loader"):
        llm = LLM(str(path), **ENGINE)
    assert "gptq experts dequantized to the run dtype at load: on the CPU FusedMoE multiplies dense experts" \
        in caplog.text
    # 2 layers x 8 experts x gate, up, down
    assert "48 quantized weights dequantized to the run dtype at load (model.layers.0.mlp.experts." in caplog.text
    layer = llm.engine.runner.model.model.layers[1]
    assert isinstance(layer.self_attn.qkv_proj.format, GGUFBlocks)
    want = load_file(str(dequantized / "model.safetensors"))
    expert = "model.layers.1.mlp.experts.3"
    assert torch.equal(layer.mlp.w13[3], torch.cat([want[f"{expert}.gate_proj.weight"], want[f"{expert}.up_proj.weight"]]))
    assert torch.equal(layer.mlp.w2[3], want[f"{expert}.down_proj.weight"])
