"""The HF transformers baseline for `ember bench throughput --compare hf`.

Static batching, as `vllm bench throughput --backend hf` does: prompts in batches of
`batch_size`, LEFT-padded with an attention mask, each batch run by `model.generate` with
sampling at temperature 1 (no top-k, no top-p) and `min_new_tokens == max_new_tokens`, so
EOS never ends a row early (ember's ignore_eos). A batch runs to its longest requested output;
each request is credited with the tokens it asked for, so the padding work is HF's cost.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from ember.bench.results import RandomRequest, ThroughputResult


def load_hf_model(model: str, dtype: str, device: str = "cpu", random_weights: bool = False) -> torch.nn.Module:
    """The same weights through transformers: a .gguf file (dequantized) or an HF directory;
    with `random_weights` (ember's dummy load format) HF's own random init of the config."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(model)
    torch_dtype = getattr(torch, dtype)
    if random_weights:
        with torch.device(device):
            hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(path)), dtype=torch_dtype)
    elif path.suffix == ".gguf":
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch_dtype)
    else:
        hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch_dtype)
    return hf.to(device).eval()


def bench_hf(model: str, requests: list[RandomRequest], dtype: str, batch_size: int, seed: int,
             device: str = "cpu", random_weights: bool = False) -> ThroughputResult:
    hf = load_hf_model(model, dtype, device, random_weights)
    pad_id = _pad_id(hf)
    torch.manual_seed(seed)
    _generate(hf, [requests[0].prompt_token_ids[:4]], 2, pad_id)  # warm-up
    output_tokens = 0
    start = time.perf_counter()
    for i in range(0, len(requests), batch_size):
        batch = requests[i:i + batch_size]
        new = _generate(hf, [r.prompt_token_ids for r in batch], max(r.output_len for r in batch), pad_id)
        output_tokens += sum(min(r.output_len, new) for r in batch)
    if device == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    return ThroughputResult(
        label=f"hf transformers ({Path(model).name}, {dtype}, batch {batch_size}, {device})",
        num_requests=len(requests),
        prompt_tokens=sum(len(r.prompt_token_ids) for r in requests),
        output_tokens=output_tokens,
        elapsed_s=elapsed,
    )


def _generate(hf: torch.nn.Module, prompts: list[list[int]], new_tokens: int, pad_id: int) -> int:
    """One static batch, left-padded; returns the number of new tokens each row got."""
    width = max(len(p) for p in prompts)
    device = next(hf.parameters()).device
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    out = hf.generate(
        input_ids=input_ids, attention_mask=attention_mask, pad_token_id=pad_id,
        max_new_tokens=new_tokens, min_new_tokens=new_tokens,
        do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
    )
    return out.shape[1] - width


def _pad_id(hf: torch.nn.Module) -> int:
    for value in (hf.generation_config.pad_token_id, hf.config.pad_token_id, hf.generation_config.eos_token_id):
        if isinstance(value, list):
            value = value[0] if value else None
        if value is not None:
            return int(value)
    return 0
