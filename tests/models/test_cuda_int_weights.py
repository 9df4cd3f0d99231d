"""On CUDA (`-m gpu`): AWQ, GPTQ and compressed-tensors checkpoints in the whole engine (bf16
activations, Triton attention, CUDA graphs on) against ember's bf16 engine on the same
checkpoint's dequantized weights, at a small Llama shape (hidden 1024, 8 heads of 128, 4 KV
heads, intermediate 3072, 6 layers). The integer weights are the dequantized ones exactly,
so what differs is the reference's bfloat16 rounding of them (and, with act-order, the
kernels' own) and the order of the sums: logits within 5 % of the mean |logit| (printed),
argmax agreement at least 70 % (random weights give near-flat logits; printed), the
reference fed the engine's greedy tokens agreeing as often; one row (the GEMV) within 2 %.
Decode batches of 1 to 8 replay the graphs (the GEMV up to 4 rows, the tensor-core matmul
beyond), graphs against eager reported, and the linear layers' bytes fall to about
bits / 16 of bf16's."""

from __future__ import annotations

import pytest
import torch
from cuda_llama_shape import ARGS, LINEAR_WEIGHTS, random_prompts, write_dense_checkpoint
from int_checkpoints import FORMS, write_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

# the forms in int_checkpoints.FORMS packed here; the others ct_checkpoints.FORMS, the compressed-tensors library's
CUDA_FORMS = ["awq-g128", "gptq-int4-g128", "gptq-int4-asym-actorder-g64-v2", "gptq-int8-channel", "w4a16-g128",
              "w4a16-asym-g128", "w8a16-channel"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return write_dense_checkpoint(tmp_path_factory.mktemp("llama-int"))


def _compare(name: str, got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    agree = total = 0
    errors, scales = [], []
    for g, w in zip(got, want):
        errors.append((g.float() - w.float()).abs().mean().item())
        scales.append(w.float().abs().mean().item())
        agree += (g.argmax(-1) == w.argmax(-1)).sum().item()
        total += len(g)
    error = sum(errors) / sum(scales)
    print(f"{name}: mean |diff| / mean |logit| = {error:.4f}, argmax agreement {agree}/{total} = {agree / total:.3f}")
    assert error < 0.05 and agree / total >= 0.7


@pytest.mark.parametrize("form", CUDA_FORMS)
def test_checkpoint_on_cuda_stays_close_to_its_dequantized_weights(base, form, forward_logits):
    from ember import LLM, SamplingParams
    from ember.layers.quant.int_weight import IntWeight

    if form in FORMS:
        method, bits, group, symmetric, act, v1 = FORMS[form]
        qdir, ddir = write_checkpoint(base, base.parent / f"llama-int-{form}", method, bits, group, symmetric, act, v1)
    else:
        import ct_checkpoints

        method, bits = "compressed-tensors", ct_checkpoints.FORMS[form][0]().weights.num_bits
        qdir = ct_checkpoints.write_checkpoint(base, base.parent / f"llama-int-{form}", form)
        ddir = ct_checkpoints.dequantize_checkpoint(qdir)
    llm = LLM(str(qdir), **ARGS)
    runner = llm.engine.runner
    assert llm.config.quantization == method and runner.graphs is not None
    assert all(isinstance(m.format, IntWeight) for n, m in runner.model.named_modules()
               if n.endswith(("qkv_proj", "o_proj", "gate_up_proj", "down_proj")))
    reference = LLM(str(ddir), **ARGS)
    saved = reference.engine.runner.weight_bytes - runner.weight_bytes
    print(f"{form}: weights {runner.weight_bytes / 2**20:.1f} MiB, bf16 {reference.engine.runner.weight_bytes / 2**20:.1f}")
    assert saved >= LINEAR_WEIGHTS * 2 * (1 - bits / 16 - 0.05)  # bits a weight, and the scales and zeros
    prompts = random_prompts(8)
    _compare(f"{form} vs bf16 on its dequantized weights", forward_logits(llm, prompts),
             forward_logits(reference, prompts))
    one, want = forward_logits(llm, [[5]])[0].float(), forward_logits(reference, [[5]])[0].float()
    print(f"{form}, one row (GEMV): mean |diff| {(one - want).abs().mean():.5f}, mean |logit| {want.abs().mean():.3f}")
    assert (one - want).abs().mean() < 0.02 * want.abs().mean() + 1e-3
    # the reference fed this engine's greedy tokens (decoded through the graphs)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    prompts = random_prompts(8, seed=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    full = [p + o.outputs[0].token_ids[:-1] for p, o in zip(prompts, outs)]
    agree = total = 0
    for p, o, logits in zip(prompts, outs, forward_logits(reference, full)):
        gen = torch.tensor(o.outputs[0].token_ids)
        agree += (logits[len(p) - 1:].argmax(-1).cpu() == gen).sum().item()
        total += len(gen)
    print(f"{form}: greedy tokens the bf16 engine agrees with: {agree}/{total} = {agree / total:.3f}")
    assert agree / total >= 0.7
    # decode batches 1..8 through the graphs (padded 1, 2, 4, 8): the GEMV and the matmul
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    batch = [{"prompt_token_ids": p} for p in random_prompts(8, seed=2)]
    for n in (1, 3, 5, 8):
        assert all(len(o.outputs[0].token_ids) == 16 for o in llm.generate(batch[:n], params))
    eager = LLM(str(qdir), enforce_eager=True, **ARGS)
    graphs = [o.outputs[0].token_ids for o in llm.generate(batch[:5], params)]
    plain = [o.outputs[0].token_ids for o in eager.generate(batch[:5], params)]
    print(f"{form}, graphs vs eager: {sum(a == b for a, b in zip(graphs, plain))}/5 greedy sequences identical")
    llm.check_idle()
