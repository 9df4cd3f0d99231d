"""How closely ember follows HF transformers on the same weights: the two measures the CUDA
model tests share. Each prints what it measured, asserts its bound and returns the share of
positions where ember and HF pick the same token."""

from __future__ import annotations

import torch


def logits_agreement(label: str, llm, hf, prompts: list[list[int]], forward_logits,
                     rel: float = 0.02, abs_: float = 0.01) -> float:
    """One forward of each prompt through both: mean |logit diff| < rel * mean |logit| + abs_
    per prompt; returns the argmax agreement over every position."""
    agree = total = 0
    for p, got in zip(prompts, forward_logits(llm, prompts)):
        with torch.no_grad():
            want = hf(torch.tensor([p], device="cuda")).logits[0].float()
        err = (got.float() - want).abs()
        scale = want.abs().mean()
        print(f"{label} prompt {len(p):4d}: max |diff| {err.max():.4f}, mean |diff| {err.mean():.4f}, "
              f"mean |logit| {scale:.3f}")
        assert err.mean() < rel * scale + abs_
        agree += (got.argmax(-1) == want.argmax(-1)).sum().item()
        total += len(p)
    print(f"{label}: argmax agreement over all positions {agree}/{total} = {agree / total:.3f}")
    return agree / total


def greedy_agreement(label: str, llm, hf, prompts: list[list[int]], max_tokens: int = 48) -> float:
    """ember's greedy tokens, then HF fed them (teacher forcing): the share of generated
    positions where HF's greedy choice is ember's token."""
    from ember import SamplingParams

    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    agree = total = 0
    for p, o in zip(prompts, outs):
        gen = o.outputs[0].token_ids
        with torch.no_grad():
            logits = hf(torch.tensor([p + gen[:-1]], device="cuda")).logits[0, len(p) - 1:]
        agree += (logits.argmax(-1).cpu() == torch.tensor(gen)).sum().item()
        total += len(gen)
    print(f"{label}: greedy tokens HF agrees with {agree}/{total} = {agree / total:.3f}")
    return agree / total
