"""On CUDA (`-m gpu`): AWQ and GPTQ mixtures of experts in the whole engine (bf16 activations,
Triton attention, CUDA graphs on) keep their experts packed for the fused MoE kernels
(layers/moe.py, kernels/moe.py), against ember's bf16 engine on the same checkpoint's
dequantized weights: Mixtral as AWQ (4 bits, zero points), Qwen3-MoE as GPTQ at 4 bits
(symmetric) and 8 (a scale a row), at a small shape (tests/models/cuda_llama_shape.py's
attention, 4 layers of 8 experts of 1024, or 16 of 512). Each MoE layer's experts against the
reference's dense bf16 ones on the same routing (the fused GEMV at one token, the GEMM at 40:
to 2e-2 of the output's scale, printed), the experts' bytes bits / 16 of bf16's, the whole
model's logits as test_cuda_int_weights.py's (within 5 % of the mean |logit|, argmax agreement
at least 70 %), decode batches of 1 to 8 through the graphs, graphs against eager reported."""

from __future__ import annotations

import json

import pytest
import torch
from cuda_llama_shape import ARGS, CONFIG, random_prompts
from int_checkpoints import FORMS, write_checkpoint
from test_cuda_int_weights import _compare

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


# the MoE shapes: CONFIG's attention over 16 experts of 512 (Qwen3-MoE, top-4, its q / k norms) or
# 8 of 1024 (Mixtral, top-2), 4 layers
MOE_CONFIGS = {
    "qwen3_moe": CONFIG | {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_hidden_layers": 4,
                           "num_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 512,
                           "decoder_sparse_step": 1, "norm_topk_prob": True},
    "mixtral": CONFIG | {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_hidden_layers": 4,
                         "intermediate_size": 1024, "num_local_experts": 8, "num_experts_per_tok": 2},
}
MOE_FORMS = [("mixtral", "awq-g128"), ("qwen3_moe", "gptq-int4-g128"), ("qwen3_moe", "gptq-int8-channel")]


@pytest.fixture(scope="module")
def moe_base(tmp_path_factory):
    """family -> a directory of dummy weights at MOE_CONFIGS' shape (saved once)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from safetensors.torch import save_file

    from ember.loader.dummy import iter_dummy_weights
    from ember.models.config import ModelConfig

    saved = {}

    def get(family: str):
        if family not in saved:
            path = tmp_path_factory.mktemp(f"{family}-int")
            config = MOE_CONFIGS[family]
            weights = {n: t.contiguous() for n, t in iter_dummy_weights(ModelConfig.from_hf_config(config), seed=12)}
            (path / "config.json").write_text(json.dumps(config))
            save_file(weights, str(path / "model.safetensors"))
            saved[family] = path
        return saved[family]

    return get


@pytest.mark.parametrize("family,form", MOE_FORMS)
@torch.inference_mode()
def test_moe_checkpoint_on_cuda_keeps_its_experts_packed(moe_base, family, form, forward_logits):
    from ember import LLM, SamplingParams

    method, bits, group, symmetric, act, v1 = FORMS[form]
    base = moe_base(family)
    qdir, ddir = write_checkpoint(base, base.parent / f"{family}-{form}", method, bits, group, symmetric, act, v1)
    llm = LLM(str(qdir), **ARGS)
    reference = LLM(str(ddir), **ARGS)
    runner = llm.engine.runner
    assert llm.config.quantization == method and runner.graphs is not None
    pairs = [(layer.mlp, other.mlp) for layer, other in zip(runner.model.model.layers,
                                                            reference.engine.runner.model.model.layers)]
    g = torch.Generator("cuda").manual_seed(0)
    for moe, dense in pairs:
        assert moe.int_experts == (bits, group, symmetric) and moe.w13.dtype == torch.int32
        assert moe.w13.nbytes * 32 // bits == dense.w13.nbytes * 2  # int32 words of 32 / bits values; bf16
        for tokens in (1, 40):
            x = torch.randn(tokens, CONFIG["hidden_size"], device="cuda", dtype=torch.bfloat16, generator=g)
            weights, ids = moe.route(moe.gate(x))
            got, want = moe.run_experts(x, weights, ids), dense.run_experts(x, weights, ids)
            scale = want.abs().max().item()
            print(f"{family} {form} T={tokens}: |int - bf16 experts| max {(got - want).abs().max().item() / scale:.2e} "
                  "of the scale")
            torch.testing.assert_close(got, want, rtol=0, atol=2e-2 * scale)
    print(f"{family} {form}: weights {runner.weight_bytes / 2**20:.1f} MiB, bf16 "
          f"{reference.engine.runner.weight_bytes / 2**20:.1f}")
    prompts = random_prompts(8)
    _compare(f"{family} {form} vs bf16 on its dequantized weights", forward_logits(llm, prompts),
             forward_logits(reference, prompts))
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    batch = [{"prompt_token_ids": p} for p in random_prompts(8, seed=2)]
    for n in (1, 3, 8):  # decode through the graphs: the fused GEMV at one sequence, the GEMM beyond
        assert all(len(o.outputs[0].token_ids) == 16 for o in llm.generate(batch[:n], params))
    eager = LLM(str(qdir), enforce_eager=True, **ARGS)
    graphs = [o.outputs[0].token_ids for o in llm.generate(batch[:5], params)]
    plain = [o.outputs[0].token_ids for o in eager.generate(batch[:5], params)]
    print(f"{family} {form}, graphs vs eager: {sum(a == b for a, b in zip(graphs, plain))}/5 greedy sequences identical")
    llm.check_idle()
