"""Tensor parallelism on the CPU over gloo: N processes (torch.multiprocessing), each loading
its shard through load_model as LLM does and running one prefill of a fixed batch, give the
logits of one process without it, on every rank: a tiny random Llama saved by transformers
(8 q / 2 KV heads, vocabulary 322: padded at TP=4) at TP=2 and TP=4 (each KV head held by two
ranks), in FP8 at TP=2, one row through the GEMV kernels at TP=2, and as GPTQ at TP=2 (GGUF
blocks on the CPU; act-order through the CUDA kernels on the interpreter; a group spanning two
ranks refused); a tiny Phi-3 (q|k|v and gate|up stored merged) at TP=2; SmolLM2-135M's GGUF
(9 q / 3 KV heads, tied head) at TP=3, dequantized and in its Q4_1 blocks; mixtures of experts
at TP=2 (Qwen2-MoE's shared expert, DeepSeek-V2's latent attention and experts, gpt-oss's
biased experts, Llama 4's input-scaled ones; Qwen3-Next's gated DeltaNet and gated attention
over experts), DeepSeek-V3's block-scaled FP8 experts kept FP8 as on CUDA (each rank whole
128-row blocks), and a GPTQ Qwen3-MoE's integer experts kept packed as on CUDA (each rank whole
groups). A split that does not fit is refused with the fix, and a rank that fails fails the run
at once, with no process left."""

from __future__ import annotations

import dataclasses
import json
import queue
import shutil
import socket
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
import triton_interpreter  # noqa: F401  (the fused MoE kernels' loops on Triton's interpreter, in the ranks too)
from qwen3_next_model import QWEN3_NEXT, save_for_llama_cpp, save_qwen3_next

from ember.distributed import parallel_state
from ember.distributed.sharding import HeadShard, shard_heads, split_evenly, vocab_rows
from ember.layers.attention import AttentionMetadata
from ember.layers.kernel_paths import gemv_on_cpu
from ember.layers.quant.gguf_blocks import BlockTensor
from ember.loader.model_files import load_model, locate_model
from ember.runner.recurrent_state import RecurrentStates

PROMPTS = [[1, 5, 9, 14, 20, 33, 2, 7, 101, 64, 17, 3], [1, 250, 8, 41, 300]]  # two sequences, one prefill
BLOCK = 16
JOIN_TIMEOUT_S = 120.0  # a rank that reports nothing by then fails the test (no hang)

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 322, "hidden_size": 64,
    "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
    "head_dim": 8, "rms_norm_eps": 1e-6, "max_position_embeddings": 128, "rope_theta": 10000.0,
    "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
}


def prefill_logits(model_path: str, prompts: list[list[int]], quantization: str = "none",
                   load_format: str = "auto", cuda_paths: bool = False, keep_fp8_experts: bool = False) -> torch.Tensor:
    """The float32 model as LLM loads it (CPU, torch attention, weights prepacked), one
    prefill of `prompts` over a small paged KV cache of its own: logits [tokens, vocab].
    cuda_paths: unpacked weights, and the CUDA kernels run by Triton's interpreter.
    keep_fp8_experts: an FP8 checkpoint's experts kept FP8, as load_model keeps them on CUDA."""
    files = locate_model(model_path, load_format)
    cfg = files.model_config()
    if keep_fp8_experts:
        from ember.loader.fp8_checkpoint import fp8_experts

        cfg = dataclasses.replace(cfg, fp8_experts=fp8_experts(cfg, files.quantization_scheme()))
    if cuda_paths:  # the load too: integer weights take their CUDA format there
        with gemv_on_cpu():
            model = load_model(files, cfg, max_positions=128, dtype=torch.float32, device="cpu",
                               attention_backend="torch", quantization=quantization)
            return _prefill(model, prompts)
    model = load_model(files, cfg, max_positions=128, dtype=torch.float32, device="cpu", attention_backend="torch",
                       quantization=quantization)
    for module in model.modules():
        if hasattr(module, "pack_for_cpu"):
            module.pack_for_cpu()
    return _prefill(model, prompts)


def _prefill(model: torch.nn.Module, prompts: list[list[int]]) -> torch.Tensor:
    per_seq = -(-max(map(len, prompts)) // BLOCK)
    for attn in model.attention_layers():  # this rank's KV heads
        attn.k_cache = torch.zeros(len(prompts) * per_seq, BLOCK, attn.num_kv_heads, attn.head_dim)
        attn.v_cache = torch.zeros_like(attn.k_cache)
    state_slots = {}
    if model.config.linear_layers is not None:  # sequence i's recurrent state in slot i, this rank's heads
        RecurrentStates(model.linear_attention_layers(), len(prompts), torch.float32, torch.device("cpu"))
        state_slots = dict(state_slots=torch.arange(len(prompts)), state_slots_cpu=list(range(len(prompts))))
    lens = [len(p) for p in prompts]
    # sequence i owns blocks [i * per_seq, (i + 1) * per_seq)
    slots = torch.cat([i * per_seq * BLOCK + torch.arange(n) for i, n in enumerate(lens)])
    meta = AttentionMetadata(
        slot_mapping=slots, query_start_loc=torch.tensor([0] + np.cumsum(lens).tolist(), dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=torch.arange(len(prompts) * per_seq, dtype=torch.int32).view(len(prompts), per_seq),
        query_lens_cpu=lens, seq_lens_cpu=lens, **state_slots)
    ids = torch.tensor([t for p in prompts for t in p])
    positions = torch.cat([torch.arange(n) for n in lens])
    with torch.inference_mode():
        return model.compute_logits(model(ids, positions, meta)).float()


def _rank_main(rank: int, world: int, init_method: str, out_dir: str, reports: mp.Queue, task: Callable,
               args: tuple, backend: str) -> None:
    """One rank: join the group, run task(*args), save what it returns; report None or the traceback."""
    try:
        torch.set_num_threads(1)
        if backend == "nccl":
            torch.cuda.set_device(rank)
        parallel_state.init_tensor_parallel(rank, world, backend, init_method, timeout_s=JOIN_TIMEOUT_S)
        torch.save(task(*args), Path(out_dir) / f"rank{rank}.pt")
        reports.put((rank, None))
    except BaseException:
        reports.put((rank, traceback.format_exc()))
    finally:
        parallel_state.destroy()


def run_ranks(world: int, model_path: str, tmp_path: Path, quantization: str = "none",
              load_format: str = "auto") -> list[torch.Tensor]:
    """Every rank's logits of PROMPTS."""
    return run_task(world, tmp_path, prefill_logits, (model_path, PROMPTS, quantization, load_format))


def _pool_rank_main(rank: int, world: int, init_method: str, tasks: mp.Queue, reports: mp.Queue) -> None:
    """One rank of a _RankPool: join the group once, then run each (out_dir, task, args) sent,
    save what it returns and report None or the traceback, until None comes."""
    try:
        torch.set_num_threads(1)
        parallel_state.init_tensor_parallel(rank, world, "gloo", init_method, timeout_s=JOIN_TIMEOUT_S)
        while (job := tasks.get()) is not None:
            out_dir, task, args = job
            try:
                torch.save(task(*args), Path(out_dir) / f"rank{rank}.pt")
                reports.put((rank, None))
            except BaseException:
                reports.put((rank, traceback.format_exc()))
    except BaseException:
        reports.put((rank, traceback.format_exc()))
    finally:
        parallel_state.destroy()


class _RankPool:
    """`world` ranks started once (each start imports torch and ember: seconds) that run
    prefill_logits for one test after another in the same gloo group; a failure ends them all."""

    def __init__(self, world: int) -> None:
        import tempfile

        ctx = mp.get_context("spawn")
        self.reports = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world)]
        self.dir = Path(tempfile.mkdtemp(prefix="tp-pool-"))
        init = f"file://{self.dir / 'rendezvous'}"
        self.procs = [ctx.Process(target=_pool_rank_main, args=(r, world, init, self.tasks[r], self.reports),
                                  daemon=True) for r in range(world)]
        for p in self.procs:
            p.start()

    def run(self, out: Path, task: Callable, args: tuple) -> None:
        for q in self.tasks:
            q.put((str(out), task, args))
        _wait_reports(self.procs, self.reports)

    def close(self, kill: bool = False) -> None:
        if not kill:
            for q in self.tasks:
                q.put(None)
        for p in self.procs:
            p.join(timeout=0 if kill else 5)
            if p.is_alive():
                p.kill()
                p.join()
        shutil.rmtree(self.dir, ignore_errors=True)


_POOLS: dict[int, _RankPool] = {}


def _close_rank_pools() -> None:
    while _POOLS:
        _POOLS.popitem()[1].close()


@pytest.fixture(scope="module", autouse=True)
def _rank_pools():
    yield
    _close_rank_pools()


def _wait_reports(procs: list, reports: mp.Queue) -> None:
    """Until every rank reported success; the first failure (a report, or an exit without one)
    or JOIN_TIMEOUT_S raises."""
    world = len(procs)
    done: set[int] = set()
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    while len(done) < world:
        try:
            rank, error = reports.get(timeout=1.0)
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if r not in done and p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"rank {dead[0]} exited with code {procs[dead[0]].exitcode} and no report")
            if time.monotonic() > deadline:
                raise TimeoutError(f"ranks {sorted(set(range(world)) - done)} did not finish in {JOIN_TIMEOUT_S} s")
            continue
        if error is not None:
            raise RuntimeError(f"rank {rank} of {world} failed:\n{error}")
        done.add(rank)


def run_task(world: int, tmp_path: Path, task: Callable, args: tuple, backend: str = "gloo",
             init: str | None = None) -> list:
    """What task(*args) returns on each of `world` ranks (over NCCL: rank r on GPU r), met at
    `init` (default: a file in tmp_path). The first rank to fail (an exception, or an exit
    without a report) fails the call with its error, and every process is ended: none is left
    behind. prefill_logits over gloo runs on the module's ranks of that world size (_RankPool),
    started at its first call; the other tasks on ranks of their own."""
    out = tmp_path / f"{task.__name__}-{world}"
    out.mkdir()
    if task is prefill_logits and backend == "gloo" and init is None:
        pool = _POOLS.get(world) or _POOLS.setdefault(world, _RankPool(world))
        try:
            pool.run(out, task, args)
        except BaseException:
            del _POOLS[world]
            pool.close(kill=True)
            raise
        return [torch.load(out / f"rank{r}.pt") for r in range(world)]
    ctx = mp.get_context("spawn")
    reports = ctx.Queue()
    init = init or f"file://{out / 'rendezvous'}"
    procs = [ctx.Process(target=_rank_main, args=(r, world, init, str(out), reports, task, args, backend),
                         daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    finished = False
    try:
        _wait_reports(procs, reports)
        finished = True
    finally:
        for p in procs:  # after a failure the others may wait in a collective for good: end them
            p.join(timeout=5 if finished else 0)
            if p.is_alive():
                p.kill()
                p.join()
    return [torch.load(out / f"rank{r}.pt") for r in range(world)]


def _save_tiny(config: dict, path: Path) -> str:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    hf_config = transformers.AutoConfig.for_model(**config)
    transformers.AutoModelForCausalLM.from_config(hf_config).save_pretrained(str(path))
    assert json.loads((path / "config.json").read_text())["num_key_value_heads"] == 2
    return str(path)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    return _save_tiny(TINY_LLAMA, tmp_path_factory.mktemp("tiny-llama-tp"))


@pytest.fixture(scope="module")
def tiny_phi3(tmp_path_factory) -> str:
    """Phi-3's checkpoints store q|k|v and gate|up merged: each rank cuts them up."""
    return _save_tiny(TINY_LLAMA | {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3"},
                      tmp_path_factory.mktemp("tiny-phi3-tp"))


def _save_perturbed(model_type: str, path: Path, **sizes) -> str:
    """A tiny model of transformers' own, every parameter moved (its biases and norms count)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    hf_config = transformers.AutoConfig.for_model(model_type, vocab_size=322, bos_token_id=1, eos_token_id=2, **sizes)
    model = transformers.AutoModelForCausalLM.from_config(hf_config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="module")
def tiny_phi2(tmp_path_factory) -> str:
    """Phi-2's layout: LayerNorm, biased projections and LM head (its bias split by vocabulary
    rows like the head), a plain MLP (fc1 by rows, fc2 by columns), partial RoPE."""
    return _save_perturbed("phi", tmp_path_factory.mktemp("tiny-phi2-tp"), hidden_size=64, intermediate_size=96,
                           num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                           max_position_embeddings=128, partial_rotary_factor=0.5)


@pytest.fixture(scope="module")
def tiny_gpt2(tmp_path_factory) -> str:
    """GPT-2's q|k|v stored as one Conv1D: each rank cuts its heads out of it; learned positions."""
    return _save_perturbed("gpt2", tmp_path_factory.mktemp("tiny-gpt2-tp"), n_embd=64, n_layer=2, n_head=8,
                           n_positions=128)


# mixtures of experts: each expert's intermediate rows split among the ranks, the router whole
MOE_SIZES = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=8, max_position_embeddings=128)


@pytest.fixture(scope="module")
def tiny_qwen2_moe(tmp_path_factory) -> str:
    """Routed experts beside a shared expert with its sigmoid gate (both split by rows)."""
    return _save_perturbed("qwen2_moe", tmp_path_factory.mktemp("tiny-qwen2-moe-tp"), **MOE_SIZES,
                           num_key_value_heads=2, intermediate_size=96, moe_intermediate_size=32,
                           shared_expert_intermediate_size=48, num_experts=4, num_experts_per_tok=2)


@pytest.fixture(scope="module")
def tiny_deepseek_v2(tmp_path_factory) -> str:
    """Multi-head latent attention (the query heads split, the latent whole on each rank) over
    DeepSeekMoE (a dense first layer, shared experts)."""
    return _save_perturbed("deepseek_v2", tmp_path_factory.mktemp("tiny-deepseek-tp"), **MOE_SIZES,
                           num_key_value_heads=8, intermediate_size=96, moe_intermediate_size=24, kv_lora_rank=32,
                           q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                           n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
                           topk_method="greedy", n_group=1, topk_group=1)


@pytest.fixture(scope="module")
def tiny_gpt_oss(tmp_path_factory) -> str:
    """Biased experts (the down bias added by rank 0 alone), the clamped SwiGLU, sinks a head."""
    return _save_perturbed("gpt_oss", tmp_path_factory.mktemp("tiny-gpt-oss-tp"), **MOE_SIZES,
                           num_key_value_heads=2, head_dim=8, intermediate_size=64, num_local_experts=4,
                           num_experts_per_tok=2, sliding_window=8)


@pytest.fixture(scope="module")
def tiny_llama4(tmp_path_factory) -> str:
    """Top-1 experts scaled on their input, stacked [E, in, out], beside a shared expert."""
    return _save_perturbed("llama4_text", tmp_path_factory.mktemp("tiny-llama4-tp"), **MOE_SIZES,
                           num_key_value_heads=2, head_dim=8, intermediate_size=32, intermediate_size_mlp=96,
                           num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=1,
                           attention_chunk_size=8)


@pytest.fixture(scope="module")
def tiny_qwen3_next(tmp_path_factory) -> str:
    """Gated DeltaNet layers (each rank one key head of 16 dims and the two value heads of 24 it
    serves: their rows of q, k, v, z, b and a, their conv channels, decays and recurrent state;
    out_proj by columns) before a gated attention layer (each head's query with its gate), over
    Qwen2-MoE's experts."""
    path = tmp_path_factory.mktemp("tiny-qwen3-next-tp")
    save_qwen3_next(QWEN3_NEXT | {"vocab_size": 322}, path)
    return str(path)


@pytest.mark.parametrize(("model", "world"), [("tiny_llama", 2), ("tiny_llama", 4), ("tiny_phi3", 2), ("tiny_phi2", 4),
                                              ("tiny_gpt2", 2), ("tiny_qwen2_moe", 2), ("tiny_deepseek_v2", 2),
                                              ("tiny_gpt_oss", 2), ("tiny_llama4", 2), ("tiny_qwen3_next", 2)])
def test_tiny_models_split_give_the_logits_of_one_process(request, tmp_path, model, world):
    path = request.getfixturevalue(model)
    expected = prefill_logits(path, PROMPTS)
    ranks = run_ranks(world, path, tmp_path)
    assert expected.shape == (sum(map(len, PROMPTS)), 322)
    assert all(torch.equal(logits, ranks[0]) for logits in ranks)  # every rank, the whole vocabulary
    torch.testing.assert_close(ranks[0], expected, rtol=0, atol=1e-5)
    assert torch.equal(ranks[0].argmax(-1), expected.argmax(-1))


@pytest.fixture(scope="module")
def tiny_qwen3_next_gguf(tmp_path_factory, bpe_tokenizer_dir, gguf_convert) -> str:
    """The tiny Qwen3-Next through llama.cpp's converter: q | k | v (attn_qkv) and z (attn_gate)
    as two tensors, ssm_ba's rows by key head, ssm_a = -exp(A_log)."""
    pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("tiny-qwen3-next-gguf-tp")
    save_for_llama_cpp(path, bpe_tokenizer_dir)
    return str(gguf_convert(path, "f32"))


def test_qwen3_next_gguf_split_gives_the_logits_of_one_process(tiny_qwen3_next_gguf, tmp_path):
    """Each rank its key heads' rows of the GGUF's q | k | v (cut into in_proj_qkvz's q, k and v
    shards at load) and of z."""
    expected = prefill_logits(tiny_qwen3_next_gguf, PROMPTS)
    ranks = run_ranks(2, tiny_qwen3_next_gguf, tmp_path)
    assert all(torch.equal(logits, ranks[0]) for logits in ranks)
    torch.testing.assert_close(ranks[0], expected, rtol=0, atol=1e-5)
    assert torch.equal(ranks[0].argmax(-1), expected.argmax(-1))


def test_one_row_through_the_gemv_kernels(tiny_llama, tmp_path):
    """One token: the CUDA GEMV (Triton's interpreter) with the norm fused into q|k|v and
    gate|up and the SiLU into down, whose output is reduced after the kernel."""
    pytest.importorskip("triton")
    expected = prefill_logits(tiny_llama, [[250]], cuda_paths=True)
    ranks = run_task(2, tmp_path, prefill_logits, (tiny_llama, [[250]], "none", "auto", True))
    torch.testing.assert_close(ranks[0], expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(ranks[0], prefill_logits(tiny_llama, [[250]]), rtol=0, atol=1e-5)


LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def tiny_llama_fp8(tiny_llama, tmp_path_factory) -> str:
    """The tiny Llama as an FP8 checkpoint (quant_method fp8, a scale per tensor: per row at load)."""
    from safetensors.torch import load_file, save_file

    path = tmp_path_factory.mktemp("tiny-llama-fp8")
    tensors = {}
    for name, t in load_file(str(Path(tiny_llama) / "model.safetensors")).items():
        if name.removesuffix(".weight").endswith(LINEAR):
            scale = t.abs().max() / 448
            tensors |= {name: (t / scale).to(torch.float8_e4m3fn), name.replace(".weight", ".weight_scale"): scale}
        else:
            tensors[name] = t
    save_file(tensors, str(path / "model.safetensors"))
    config = TINY_LLAMA | {"quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic"}}
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def test_fp8_weights_split_give_the_logits_of_one_process(tiny_llama_fp8, tmp_path):
    """FP8 kept (quantization='fp8'; on the CPU the weight is dequantized at each matmul): each
    rank its rows with their scales, or its columns beside the same row scales."""
    expected = prefill_logits(tiny_llama_fp8, PROMPTS, quantization="fp8")
    ranks = run_ranks(2, tiny_llama_fp8, tmp_path, quantization="fp8")
    assert all(torch.equal(logits, ranks[0]) for logits in ranks)
    torch.testing.assert_close(ranks[0], expected, rtol=0, atol=1e-5)
    assert torch.equal(ranks[0].argmax(-1), expected.argmax(-1))


def test_fp8_block_scales_split_on_whole_blocks():
    from ember.layers.quant.fp8 import FP8Tensor

    weight = torch.randn(384, 256)
    scale = torch.rand(3, 2) + 0.5
    tensor = FP8Tensor(weight.to(torch.float8_e4m3fn), scale)
    full = tensor.dequantize()
    assert torch.equal(tensor.narrow(0, 128, 256).dequantize(), full[128:])
    assert torch.equal(tensor.narrow(1, 128, 128).dequantize(), full[:, 128:])
    assert torch.equal(tensor.narrow(0, 256, 128).pad_rows(200).dequantize(), torch.cat([full[256:], torch.zeros(72, 256)]))
    with pytest.raises(ValueError, match=r"columns \[64, 128\) of an FP8 weight cut its 128 x 128 scale blocks: load "
                                         r"the model with quantization='none'"):
        tensor.narrow(1, 64, 64)
    rows = FP8Tensor(weight.to(torch.float8_e4m3fn), torch.rand(384))  # a scale per row: any cut
    assert torch.equal(rows.narrow(0, 10, 20).dequantize(), rows.dequantize()[10:30])
    assert torch.equal(rows.narrow(1, 10, 20).dequantize(), rows.dequantize()[:, 10:30])


# DeepSeek-V3's layout, its sizes so that two ranks split every expert on whole 128-row blocks
TINY_DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 322, "hidden_size": 64,
    "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 8, "max_position_embeddings": 128,
    "bos_token_id": 1, "eos_token_id": 2, "rms_norm_eps": 1e-6, "kv_lora_rank": 32, "q_lora_rank": 24,
    "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 12, "moe_intermediate_size": 256,
    "n_shared_experts": 1, "n_routed_experts": 8, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
    "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True, "scoring_func": "sigmoid",
    "topk_method": "noaux_tc", "tie_word_embeddings": False, "rope_theta": 10000.0,
    "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
}


def save_tiny_deepseek_v3_fp8(path: Path, blockwise: bool) -> str:
    """Its routed experts in FP8 with a scale per 128 x 128 block (0.5x to 1.5x of one another)
    or one per tensor, the other tensors left unquantized (as an ignore-list leaves them)."""
    from safetensors.torch import save_file

    from ember.loader.dummy import iter_dummy_weights
    from ember.models.config import ModelConfig

    g = torch.Generator().manual_seed(3)
    unit = 0.02 / 64  # the dummy draws' deviation over 64: fp8 values of deviation 64
    tensors = {}
    for name, t in iter_dummy_weights(ModelConfig.from_hf_config(TINY_DEEPSEEK_V3), seed=3):
        if ".experts." in name:
            blocks = (-(-t.shape[0] // 128), -(-t.shape[1] // 128)) if blockwise else ()
            tensors |= {name: (t / unit).clamp(-448, 448).to(torch.float8_e4m3fn),
                        name + ("_scale_inv" if blockwise else "_scale"): unit * (0.5 + torch.rand(blocks, generator=g))}
        else:
            tensors[name] = t.contiguous()
    save_file(tensors, str(path / "model.safetensors"))
    quantization = {"quant_method": "fp8", "activation_scheme": "dynamic"} | \
        ({"weight_block_size": [128, 128]} if blockwise else {})
    (path / "config.json").write_text(json.dumps(TINY_DEEPSEEK_V3 | {"quantization_config": quantization}))
    return str(path)


@pytest.fixture(scope="module")
def tiny_deepseek_v3_fp8(tmp_path_factory) -> str:
    return save_tiny_deepseek_v3_fp8(tmp_path_factory.mktemp("tiny-deepseek-v3-fp8"), blockwise=True)


@pytest.mark.parametrize("blockwise", [True, False], ids=["block", "tensor"])
def test_fp8_experts_kept_give_the_logits_of_their_dequantized_weights(blockwise, tiny_deepseek_v3_fp8, tmp_path):
    """One process: the experts kept FP8 (float8 values with their block scales, or a scale per
    tensor made per row; FusedMoE's torch path dequantizes them whole each call) give, bit for
    bit, the logits of the same checkpoint with its experts dequantized at load: the same
    float32 weights. (The fused kernels on them: tests/kernels/test_moe_kernels.py, where the
    interpreter runs their loops.)"""
    from ember.loader.fp8_checkpoint import fp8_experts

    path = tiny_deepseek_v3_fp8 if blockwise else save_tiny_deepseek_v3_fp8(tmp_path, blockwise=False)
    files = locate_model(path, "auto")
    cfg = dataclasses.replace(files.model_config(), fp8_experts=fp8_experts(files.model_config(),
                                                                            files.quantization_scheme()))
    moe = load_model(files, cfg, 128, torch.float32, "cpu", "torch", quantization="fp8").model.layers[1].mlp
    assert (moe.w13.dtype, moe.w2.dtype) == (torch.float8_e4m3fn,) * 2
    # each half of I = 256 two row blocks, or a scale a row
    assert (moe.w13_scale.shape, moe.w2_scale.shape) == (((8, 4, 1), (8, 1, 2)) if blockwise else ((8, 512), (8, 64)))
    assert torch.equal(prefill_logits(path, PROMPTS, "fp8", keep_fp8_experts=True), prefill_logits(path, PROMPTS, "fp8"))


def test_fp8_experts_split_give_the_logits_of_one_process(tiny_deepseek_v3_fp8, tmp_path):
    """Two ranks, each expert's rows [0, 128) or [128, 256) of its gate and up (the first or
    second scale block of each half) and the same columns of its down."""
    path = tiny_deepseek_v3_fp8
    expected = prefill_logits(path, PROMPTS, "fp8", keep_fp8_experts=True)
    ranks = run_task(2, tmp_path, prefill_logits, (path, PROMPTS, "fp8", "auto", False, True))
    assert all(torch.equal(logits, ranks[0]) for logits in ranks)
    torch.testing.assert_close(ranks[0], expected, rtol=0, atol=1e-5)
    assert torch.equal(ranks[0].argmax(-1), expected.argmax(-1))


def test_fp8_experts_split_across_scale_blocks_are_refused_with_the_fix(tiny_deepseek_v3_fp8, tmp_path):
    with pytest.raises(RuntimeError, match=r"(?s)rank \d of 4 failed:.*ValueError: tensor parallelism over 4 ranks gives "
                                           r"rank \d rows \[\d+, \d+\) of each expert's 256 \(moe_intermediate_size\), "
                                           r"which cuts the FP8 experts' 128-row scale blocks: use a "
                                           r"tensor_parallel_size that splits moe_intermediate_size into multiples of "
                                           r"128, or quantization='none'"):
        run_task(4, tmp_path, prefill_logits, (tiny_deepseek_v3_fp8, PROMPTS, "fp8", "auto", False, True))


@pytest.fixture(scope="module")
def tiny_llama_int(tmp_path_factory) -> Path:
    """A tiny Llama whose row-parallel inputs (o: 128 columns, down: 256) split at TP=2 into
    whole groups of 64 columns, and whole GGUF blocks of 32 on the CPU."""
    return Path(_save_tiny(TINY_LLAMA | {"hidden_size": 128, "intermediate_size": 256, "head_dim": 16},
                           tmp_path_factory.mktemp("tiny-llama-int")))


def _gptq(base: Path, group: int, act_order: bool) -> str:
    from int_checkpoints import write_checkpoint

    out = base.parent / f"{base.name}-gptq-g{group}{'-actorder' if act_order else ''}"
    return str(write_checkpoint(base, out, "gptq", 4, group, symmetric=False, act_order=act_order)[0])


def test_gptq_weights_split_on_whole_groups(tiny_llama_int, tmp_path):
    """GPTQ kept as GGUF blocks on the CPU (Q4_1: groups of 64, zero points): each rank its rows
    of q|k|v and gate|up, and whole groups of o's and down's columns with their scales."""
    path = _gptq(tiny_llama_int, 64, act_order=False)
    expected = prefill_logits(path, PROMPTS, quantization="gptq")
    ranks = run_ranks(2, path, tmp_path, quantization="gptq")
    assert all(torch.equal(logits, ranks[0]) for logits in ranks)
    torch.testing.assert_close(ranks[0], expected, rtol=0, atol=1e-5)
    assert torch.equal(ranks[0].argmax(-1), expected.argmax(-1))


def test_act_order_gptq_split_through_the_cuda_kernels(tiny_llama_int, tmp_path):
    """Act-order (a g_idx per column) through kernels/wna16.py on Triton's interpreter: a rank's
    columns of o and down keep their groups, whichever ranks those groups' other columns are on."""
    pytest.importorskip("triton")
    path = _gptq(tiny_llama_int, 64, act_order=True)
    expected = prefill_logits(path, PROMPTS, quantization="gptq", cuda_paths=True)
    ranks = run_task(2, tmp_path, prefill_logits, (path, PROMPTS, "gptq", "auto", True))
    torch.testing.assert_close(ranks[0], expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(ranks[0], prefill_logits(path, PROMPTS, quantization="none"), rtol=0, atol=1e-5)


def test_a_group_that_spans_two_ranks_is_refused_by_name(tiny_llama_int, tmp_path):
    path = _gptq(tiny_llama_int, 64, act_order=False)  # at TP=4, 32 of o's 128 columns a rank
    with pytest.raises(RuntimeError, match=r"(?s)rank \d of 4 failed:.*o_proj.weight' does not fit .*: columns "
                                           r"\[\d+, \d+\) of a weight quantized in groups of 64 columns: a group "
                                           r"spans two tensor-parallel ranks"):
        run_ranks(4, path, tmp_path, quantization="gptq")


@pytest.fixture(scope="module")
def tiny_qwen3_moe_gptq8(tmp_path_factory) -> str:
    """A tiny Qwen3-MoE saved by transformers (4 experts of intermediate 128, top-2; hidden 128)
    as an 8-bit GPTQ checkpoint with zero points in groups of 64 (v2 zeros): at TP=2 each rank
    holds rows [0, 64) or [64, 128) of every expert's gate and up and those columns (one group)
    of its down; at TP=4, 32 columns cut a group."""
    from int_checkpoints import write_checkpoint

    base = _save_perturbed("qwen3_moe", tmp_path_factory.mktemp("tiny-qwen3-moe-int"), hidden_size=128,
                           num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                           max_position_embeddings=128, moe_intermediate_size=128, num_experts=4,
                           num_experts_per_tok=2, decoder_sparse_step=1)
    saved = json.loads((Path(base) / "config.json").read_text())  # transformers 5 writes num_local_experts
    (Path(base) / "config.json").write_text(json.dumps(saved | {"num_experts": saved["num_local_experts"]}))
    return str(write_checkpoint(Path(base), Path(base).parent / "tiny-qwen3-moe-gptq8", "gptq", 8, 64,
                                symmetric=False, v1=False)[0])


def test_int_experts_split_through_the_fused_kernels(tiny_qwen3_moe_gptq8, tmp_path):
    """Integer experts kept packed (the fused MoE kernels on Triton's interpreter, as on CUDA):
    two ranks, each its rows of every expert's gate and up and its whole groups of the down's
    columns with their scales and zeros, give the logits of one process, and of the checkpoint
    dequantized at load."""
    pytest.importorskip("triton")
    path = tiny_qwen3_moe_gptq8
    files = locate_model(path, "auto")
    with gemv_on_cpu():
        moe = load_model(files, files.model_config(), 128, torch.float32, "cpu", "torch", quantization="gptq")
    assert moe.model.layers[0].mlp.int_experts == (8, 64, False)
    expected = prefill_logits(path, PROMPTS, quantization="gptq", cuda_paths=True)
    ranks = run_task(2, tmp_path, prefill_logits, (path, PROMPTS, "gptq", "auto", True))
    assert all(torch.equal(logits, ranks[0]) for logits in ranks)
    torch.testing.assert_close(ranks[0], expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(ranks[0], prefill_logits(path, PROMPTS, quantization="none"), rtol=0, atol=1e-5)


def test_int_experts_split_across_a_group_are_refused_by_name(tiny_qwen3_moe_gptq8, tmp_path):
    pytest.importorskip("triton")
    with pytest.raises(RuntimeError, match=r"(?s)rank \d of 4 failed:.*ValueError: tensor parallelism over 4 ranks gives "
                                           r"rank \d columns \[\d+, \d+\) of each expert's down projection \(128: "
                                           r"moe_intermediate_size\), which cuts its 8-bit integer groups of 64 "
                                           r"columns: use a tensor_parallel_size that splits moe_intermediate_size "
                                           r"into multiples of 64, or quantization='none'"):
        run_task(4, tmp_path, prefill_logits, (tiny_qwen3_moe_gptq8, PROMPTS, "gptq", "auto", True))


@pytest.fixture(scope="module")
def smollm2_logits(gguf_path) -> dict[str, torch.Tensor]:
    """One process's logits: the GGUF dequantized to float32, and in its blocks."""
    return {q: prefill_logits(str(gguf_path), PROMPTS, quantization=q) for q in ("none", "gguf")}


@pytest.mark.slow
def test_smollm2_at_three_ranks_gives_the_logits_of_one_process(gguf_path, smollm2_logits, tmp_path):
    """Within 1e-3 of logits up to 34 (the partial sums add in another order: measured at most
    4.4e-4, 3e-5 on average; the tiny model's stay within 1e-5), the same argmax everywhere."""
    expected = smollm2_logits["none"]
    ranks = run_ranks(3, str(gguf_path), tmp_path)
    assert all(torch.equal(logits, ranks[0]) for logits in ranks)
    torch.testing.assert_close(ranks[0], expected, rtol=0, atol=1e-3)
    assert torch.equal(ranks[0].argmax(-1), expected.argmax(-1))


@pytest.mark.slow
def test_smollm2_in_its_gguf_blocks_at_three_ranks(gguf_path, smollm2_logits, tmp_path):
    """Q4_1 blocks kept (the int8 kernels), each rank its rows, or its columns on whole blocks.
    The activations are rounded to int8 per block, so the sums' other order (1e-5 after the
    first layer) moves some of them by a step: the logits stay closer to one process's than
    that process's are to the float32 ones (measured mean |diff| 0.13 vs 0.24), with the same
    argmax but at a near-tie."""
    one, dense = smollm2_logits["gguf"], smollm2_logits["none"]
    ranks = run_ranks(3, str(gguf_path), tmp_path, quantization="gguf")
    assert all(torch.equal(logits, ranks[0]) for logits in ranks)
    assert (ranks[0] - one).abs().mean() < (one - dense).abs().mean()
    # the same argmax but at near-ties: where the picks differ, one process's logits of the two
    # lie closer than the row's largest disagreement (on an AVX-512 VNNI Xeon: one row of 17,
    # 0.009 apart against 0.58)
    ours, theirs = ranks[0].argmax(-1), one.argmax(-1)
    differ = (ours != theirs).nonzero().flatten().tolist()
    assert len(differ) <= 1, differ
    for row in differ:
        assert one[row, theirs[row]] - one[row, ours[row]] < (ranks[0][row] - one[row]).abs().max()


@pytest.fixture(scope="module")
def tiny_q4_k_m_gguf(tmp_path_factory) -> str:
    """A Q4_K_M file (llama.cpp's mix: layer 1's v and down, and the output, in Q6_K; random blocks
    by gguf-py's writer) whose K-quant rows of 256 values split on whole blocks at two ranks."""
    pytest.importorskip("gguf")
    from ember.bench.dummy_gguf import write_dummy_gguf

    config = TINY_LLAMA | {"hidden_size": 512, "intermediate_size": 512, "head_dim": 64}
    return str(write_dummy_gguf(config, tmp_path_factory.mktemp("tiny-q4-k-m") / "tiny.gguf", seed=1))


def test_q4_k_m_blocks_split_through_the_cuda_kernels(tiny_q4_k_m_gguf, tmp_path):
    """GGUF blocks kept on the CUDA paths (kernels/gguf.py on Triton's interpreter: the matmul for
    the prompts, the embedding's gather, the tied-free Q6_K head): the float32 logits of the file
    dequantized, and at two ranks (rows of q|k|v, gate|up and the vocabulary, whole super-blocks
    of o's and down's columns) the same."""
    pytest.importorskip("triton")
    expected = prefill_logits(tiny_q4_k_m_gguf, PROMPTS, quantization="none")
    one = prefill_logits(tiny_q4_k_m_gguf, PROMPTS, "gguf", cuda_paths=True)
    torch.testing.assert_close(one, expected, rtol=0, atol=1e-4 * expected.abs().max().item())
    ranks = run_task(2, tmp_path, prefill_logits, (tiny_q4_k_m_gguf, PROMPTS, "gguf", "auto", True))
    torch.testing.assert_close(ranks[0], one, rtol=0, atol=1e-4 * expected.abs().max().item())
    assert torch.equal(ranks[0].argmax(-1), expected.argmax(-1))


def test_a_split_that_does_not_fit_fails_every_rank_with_the_fix(tiny_llama, tmp_path):
    with pytest.raises(RuntimeError, match=r"(?s)rank \d of 3 failed:.*ValueError: 8 attention heads \(2 KV heads\) "
                                           r"do not divide among 3 tensor-parallel ranks: use a tensor_parallel_size "
                                           r"among \[1, 2, 4, 8\]"):
        run_ranks(3, tiny_llama, tmp_path)


def test_gguf_blocks_split_by_rows_and_by_whole_blocks_of_columns():
    """Q8_0: each block a float16 scale and 32 int8 values."""
    rows, cols = 3, 96
    blocks = np.zeros((rows, cols // 32, 34), np.uint8)
    blocks[..., :2] = np.full((rows, cols // 32), 0.5, np.float16).view(np.uint8).reshape(rows, cols // 32, 2)
    blocks[..., 2:] = (np.arange(rows * cols) % 200 - 100).astype(np.int8).view(np.uint8).reshape(rows, -1, 32)
    tensor = BlockTensor(8, (rows, cols), torch.from_numpy(blocks.reshape(rows, -1)))
    full = tensor.dequantize()
    assert torch.equal(full.flatten(), torch.tensor((np.arange(rows * cols) % 200 - 100) * 0.5, dtype=torch.float32))
    assert torch.equal(tensor.narrow(1, 32, 64).dequantize(), full[:, 32:])
    assert torch.equal(tensor.narrow(0, 1, 2).dequantize(), full[1:])
    assert torch.equal(tensor.narrow(0, 2, 1).pad_rows(3).dequantize(), torch.cat([full[2:], torch.zeros(2, cols)]))
    with pytest.raises(ValueError, match=r"columns \[48, 96\) of a Q8_0 weight cut its blocks of 32: load the model "
                                         r"with quantization='none'"):
        tensor.narrow(1, 48, 48)
def test_experts_that_do_not_split_are_refused_with_the_fix(tmp_path):
    from ember.config import EngineConfig

    qwen3_moe = TINY_LLAMA | {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_experts": 4,
                              "num_experts_per_tok": 2, "moe_intermediate_size": 30}
    (tmp_path / "config.json").write_text(json.dumps(qwen3_moe))
    with pytest.raises(ValueError, match=r"the experts' intermediate size \(moe_intermediate_size\) \(30\) does not "
                                         r"divide among 4 tensor-parallel ranks: use a tensor_parallel_size among "
                                         r"\[1, 2, 3, 5, 6, 10, 15, 30\]"):
        EngineConfig(model=str(tmp_path), load_format="dummy", device="cpu", tensor_parallel_size=4).resolve()


def test_linear_attention_key_heads_that_do_not_split_are_refused_with_the_fix(tmp_path):
    from ember.config import EngineConfig

    (tmp_path / "config.json").write_text(json.dumps(QWEN3_NEXT))  # 2 key heads (4 attention heads: they fit 4)
    with pytest.raises(ValueError, match=r"the gated DeltaNet's key heads \(linear_num_key_heads\) \(2\) does not "
                                         r"divide among 4 tensor-parallel ranks: use a tensor_parallel_size among "
                                         r"\[1, 2\]"):
        EngineConfig(model=str(tmp_path), load_format="dummy", device="cpu", tensor_parallel_size=4).resolve()


def test_heads_are_split_and_kv_heads_shared_where_fewer_than_ranks():
    assert [shard_heads(8, 2, r, 4) for r in range(4)] == [
        HeadShard(2, 1, 0, 0), HeadShard(2, 1, 2, 0), HeadShard(2, 1, 4, 1), HeadShard(2, 1, 6, 1)]
    assert [shard_heads(8, 2, r, 2) for r in range(2)] == [HeadShard(4, 1, 0, 0), HeadShard(4, 1, 4, 1)]
    assert [shard_heads(9, 3, r, 3) for r in range(3)] == [
        HeadShard(3, 1, 0, 0), HeadShard(3, 1, 3, 1), HeadShard(3, 1, 6, 2)]
    assert shard_heads(32, 8, 1, 16) == HeadShard(2, 1, 2, 0)
    with pytest.raises(ValueError, match=r"9 attention heads \(3 KV heads\) do not divide among 2 .* among \[1, 3, 9\]"):
        shard_heads(9, 3, 0, 2)
    with pytest.raises(ValueError, match=r"12 attention heads \(4 KV heads\) do not divide among 6 .* among "
                                         r"\[1, 2, 4, 12\]"):
        shard_heads(12, 4, 0, 6)  # 6 % 4 and 4 % 6 are not 0


def test_rows_and_vocabulary_split():
    assert [split_evenly(1536, r, 3, "intermediate_size") for r in range(3)] == [(0, 512), (512, 512), (1024, 512)]
    with pytest.raises(ValueError, match=r"intermediate_size \(96\) does not divide among 5 tensor-parallel ranks: "
                                         r"use a tensor_parallel_size among \[1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 96\]"):
        split_evenly(96, 0, 5, "intermediate_size")
    assert [vocab_rows(322, r, 4) for r in range(4)] == [(0, 81), (81, 81), (162, 81), (243, 81)]  # 2 rows padding


def _rank_1_fails() -> None:
    if parallel_state.tp_rank() == 1:
        raise ValueError("rank 1 broke")
    time.sleep(600)  # rank 0 would wait for good


def test_a_failing_rank_ends_the_run_at_once_and_leaves_no_process(tmp_path):
    _close_rank_pools()  # the module's ranks (run_task) are this process's children too
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"(?s)rank 1 of 2 failed:.*ValueError: rank 1 broke"):
        run_task(2, tmp_path, _rank_1_fails, ())
    assert time.monotonic() - start < 60 and mp.active_children() == []


def _collectives() -> dict[str, torch.Tensor | None]:
    rank = parallel_state.tp_rank()
    y = torch.arange(4.0).view(2, 2) + 10 * rank
    return {"sum": parallel_state.all_reduce(y.clone()), "all": parallel_state.all_gather_last_dim(y),
            "to_0": parallel_state.gather_last_dim(y), "size": torch.tensor(parallel_state.tp_size()),
            "peer": parallel_state.enable_peer_all_reduce(torch.float32)}


def test_collectives_over_three_ranks(tmp_path):
    ranks = run_task(3, tmp_path, _collectives, ())
    y = [torch.arange(4.0).view(2, 2) + 10 * r for r in range(3)]
    for r, got in enumerate(ranks):
        assert torch.equal(got["sum"], y[0] + y[1] + y[2]) and torch.equal(got["all"], torch.cat(y, -1))
        assert got["size"].item() == 3 and got["peer"] == "not a group of GPUs"
        assert torch.equal(got["to_0"], torch.cat(y, -1)) if r == 0 else got["to_0"] is None


def test_ranks_meet_at_a_store_this_process_keeps_on_a_port_it_never_lets_go(tmp_path):
    store, init = parallel_state.host_rendezvous()
    host, port = init.removeprefix("store://").rsplit(":", 1)
    assert (host, int(port)) == ("127.0.0.1", store.port)
    with socket.socket() as other, pytest.raises(OSError, match="Address already in use"):
        other.bind(("127.0.0.1", store.port))  # listening from the start: no other group can take it
    ranks = run_task(2, tmp_path, _collectives, (), init=init)
    y = [torch.arange(4.0).view(2, 2) + 10 * r for r in range(2)]
    assert [torch.equal(got["sum"], y[0] + y[1]) for got in ranks] == [True, True]
    assert [got["size"].item() for got in ranks] == [2, 2]


def test_without_a_group_this_process_is_rank_0_of_1():
    x = torch.arange(6.0).view(2, 3)
    assert (parallel_state.tp_rank(), parallel_state.tp_size(), parallel_state.tp_group()) == (0, 1, None)
    assert parallel_state.all_reduce(x) is x and parallel_state.all_gather_last_dim(x) is x
    assert parallel_state.gather_last_dim(x) is x
    with pytest.raises(ValueError, match="backend 'mpi': use 'gloo' \\(CPU\\) or 'nccl' \\(GPU\\)"):
        parallel_state.init_tensor_parallel(0, 2, "mpi")
