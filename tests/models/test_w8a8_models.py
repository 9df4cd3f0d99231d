"""compressed-tensors W8A8 checkpoints (int-quantized) of a tiny random Llama saved by
transformers, written by the compressed-tensors library (tests/ct_checkpoints.py: its W8A8
preset, and static per-tensor input scales calibrated on the prompts), loaded by ember with no
flag. The reference is transformers on the model's own weights with each quantized
linear layer replaced by the scheme's plain-torch meaning (reference_linear: the checkpoint's int8
weights and scales, x quantized per token or by its static scale, the integer sum exact, float32
after), the layers the ignore-list names left float. Two forms: llm-compressor's W8A8 (weights
per channel, activations per token) and the static one (a weight scale a tensor, calibrated
per-tensor input scales, down_proj of layer 0 ignored).

- the CPU path (torch._int_mm), teacher-forced on the reference's 32 greedy tokens: the
  reference's logits within float32 rounding at most positions (EXACT; a flip at one token
  carries through the later positions of its sequence: measured 77 % exact, the dynamic form's
  one-token prompt flipping at its second token), and within a
  rounding flip's reach (FLIP_BOUND) where the norms' and attention's float32 order moved an
  activation across an int8 rounding boundary. Such a flip moves the logits ~3e-3, and random
  models have top-2 margins far below that, so even transformers' cached greedy run parts from
  its own full forward (measured here: a margin of 9e-3 reversed): ember's free-running greedy
  tokens are checked against the reference's argmax over them wherever that is decided beyond a
  flip's reach, as the other int8-activation paths are (tests/models/test_int_weight_models.py);
- the CUDA kernels run by Triton's interpreter (dynamic form): every W8A8 layer the CPU path's
  bits, so the logits within float32 rounding of it (the LM head's GEMV sums in its own order)
  and the same first three greedy tokens;
- a mixture of experts (Qwen3-MoE): the experts dequantized at load (logged), the attention W8A8.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from family_checks import greedy_tokens, hf_greedy
from int_checkpoints import SIZES
from safetensors.torch import load_file
from w8a8_checkpoints import calibrate, reference_linear

from ember import LLM, SamplingParams
from ember.layers.kernel_paths import gemv_on_cpu
from ember.layers.quant.w8a8 import W8A8Weight

transformers = pytest.importorskip("transformers")
ct_checkpoints = pytest.importorskip("ct_checkpoints")  # needs the compressed-tensors library

pytestmark = pytest.mark.slow  # HF transformers on every model

PROMPTS = [[5, 17, 99, 3, 250, 41, 8, 77, 12, 19, 200, 6, 3], [7],
           [300, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26]]
ENGINE = dict(num_kv_blocks=64, block_size=8, max_model_len=128)
# |logit - reference| over the reference's largest |logit|: EXACT where ember and the reference
# quantized every activation alike (float32 order otherwise: measured <= 4.7e-7), FLIP_BOUND where
# the float32 order of the norms and attention moved an activation across a rounding boundary
# (one flipped int8 value moves the logits ~3e-3: measured between transformers' own cached decode
# and its full forward)
EXACT = 1e-5
FLIP_BOUND = 1e-2
KERNEL_DECODE = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
FORMS = {"dynamic": "w8a8-dynamic", "static": "w8a8-static-tensor"}  # ct_checkpoints.FORMS


class ReferenceW8A8(torch.nn.Module):
    """A linear layer as the W8A8 scheme defines it, in plain torch."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, input_scale: torch.Tensor | None) -> None:
        super().__init__()
        self.weight, self.scale = weight, scale
        self.input_scale = None if input_scale is None else float(input_scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = reference_linear(x.reshape(-1, x.shape[-1]), self.weight, self.scale, self.input_scale)
        return y.view(*x.shape[:-1], -1).to(x.dtype)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model("llama", **SIZES))
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(str(path))
    return path


def _checkpoint(base: Path, form: str) -> Path:
    amax = calibrate(base, PROMPTS) if form == "static" else None
    return ct_checkpoints.write_checkpoint(base, base.parent / f"{base.name}-w8a8-{form}", FORMS[form], amax)


def _reference_model(base: Path, checkpoint: Path):
    """transformers' model of `base` with the checkpoint's quantized layers as ReferenceW8A8."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).eval()
    tensors = load_file(str(checkpoint / "model.safetensors"))
    for name, _ in list(hf.named_modules()):
        if f"{name}.weight_scale" in tensors:
            hf.set_submodule(name, ReferenceW8A8(tensors[f"{name}.weight"], tensors[f"{name}.weight_scale"],
                                                 tensors.get(f"{name}.input_scale")))
    return hf




def _reference_logits(hf, greedy: list[list[int]]) -> list[torch.Tensor]:
    """The reference's logits over each prompt and the given tokens but the last."""
    with torch.no_grad():
        return [hf(torch.tensor([ids + toks[:-1]])).logits[0] for ids, toks in zip(PROMPTS, greedy)]


@pytest.mark.parametrize("form", sorted(FORMS))
def test_checkpoint_runs_as_the_scheme_defines_it(tiny_llama, form, forward_logits):
    path = _checkpoint(tiny_llama, form)
    hf = _reference_model(tiny_llama, path)
    greedy = [hf_greedy(hf, ids) for ids in PROMPTS]
    want = _reference_logits(hf, greedy)
    llm = LLM(str(path), **ENGINE)
    assert (llm.config.quantization, llm.config.dtype) == ("compressed-tensors", "float32")
    layers = llm.engine.runner.model.model.layers
    assert isinstance(layers[1].self_attn.qkv_proj.format, W8A8Weight)  # q|k|v stacked: one format
    assert isinstance(layers[0].mlp.down_proj.format, W8A8Weight) == (form == "dynamic")  # static: ignored
    # teacher-forced on the reference's greedy tokens: the same numbers but where a rounding flipped
    errors = [(g - w).abs().amax(-1) / w.abs().max() for g, w in zip(forward_logits(llm, [
        ids + toks[:-1] for ids, toks in zip(PROMPTS, greedy)]), want)]
    exact = float(sum((e <= EXACT).sum() for e in errors) / sum(len(e) for e in errors))
    worst = max(float(e.max()) for e in errors)
    print(f"{form}: positions within {EXACT} of the reference: {exact:.3f}; largest error {worst:.2e}")
    assert exact >= 0.6 and worst <= FLIP_BOUND
    # free-running: each greedy token the reference's argmax over ember's own tokens where it is decided
    ours = greedy_tokens(llm, PROMPTS)
    decided = total = 0
    for ids, toks, ref in zip(PROMPTS, ours, _reference_logits(hf, ours)):
        top2 = ref[len(ids) - 1:].topk(2).values
        clear = (top2[:, 0] - top2[:, 1]) > 2 * FLIP_BOUND * ref.abs().max()
        assert torch.equal(ref[len(ids) - 1:].argmax(-1)[clear], torch.tensor(toks)[clear])
        decided, total = decided + int(clear.sum()), total + len(toks)
    print(f"{form}: {decided}/{total} greedy tokens decided beyond a flip's reach, all the reference's; "
          f"{sum(a == b for a, b in zip(ours, greedy))}/3 sequences equal the reference's greedy run")
    assert decided >= 0.5 * total
    if form == "dynamic":  # the CUDA kernels on Triton's interpreter: every W8A8 layer the CPU path's bits
        with gemv_on_cpu():
            kernels = LLM(str(path), **ENGINE)
            torch.testing.assert_close(forward_logits(kernels, PROMPTS), forward_logits(llm, PROMPTS), rtol=1e-5,
                                       atol=1e-6)
            # the first 3 greedy tokens (the prefill's, then 2 decode steps of 3 rows): each step is
            # as dear as a prefill on the interpreter, and every step runs the same kernels
            outs = kernels.generate([{"prompt_token_ids": p} for p in PROMPTS], KERNEL_DECODE)
            assert [list(o.outputs[0].token_ids) for o in outs] == [toks[:3] for toks in ours]


def test_quantized_experts_are_dequantized_at_load(tmp_path_factory, caplog):
    """A W8A8 mixture of experts (Qwen3-MoE): no W8A8 MoE kernel, so the stacked experts load
    dequantized (logged: the checkpoint's int8 values times their scales, exactly) beside the
    attention kept W8A8; the router is not quantized."""
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model("qwen3_moe", **SIZES, num_experts=4, num_experts_per_tok=2,
                                               moe_intermediate_size=128, decoder_sparse_step=1)
    base = tmp_path_factory.mktemp("tiny-qwen3-moe")
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(str(base))
    saved = json.loads((base / "config.json").read_text())  # transformers 5 writes num_local_experts; Qwen's say:
    (base / "config.json").write_text(json.dumps(saved | {"num_experts": saved["num_local_experts"]}))
    path = ct_checkpoints.write_checkpoint(base, base.parent / "tiny-qwen3-moe-w8a8", "w8a8-dynamic")
    with caplog.at_level(logging.INFO, logger="ember.loader.weights"):
        llm = LLM(str(path), **ENGINE)
    # 2 layers x 4 experts x gate, up, down
    assert "24 quantized weights dequantized to the run dtype at load (model.layers.0.mlp.experts." in caplog.text
    layer = llm.engine.runner.model.model.layers[1]
    assert isinstance(layer.self_attn.qkv_proj.format, W8A8Weight)
    packed = load_file(str(path / "model.safetensors"))

    def dequantized(name: str) -> torch.Tensor:
        return packed[f"{name}.weight"].float() * packed[f"{name}.weight_scale"].float()

    expert = "model.layers.1.mlp.experts.3"
    assert torch.equal(layer.mlp.w13[3], torch.cat([dequantized(f"{expert}.gate_proj"), dequantized(f"{expert}.up_proj")]))
    assert torch.equal(layer.mlp.w2[3], dequantized(f"{expert}.down_proj"))
