"""SmolLM2 (GGUF Q4_1) in ember vs HF transformers on the same file, both float32."""

import pytest
import torch

from ember import SamplingParams

RAW_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
]
CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three fruits.",
    "How many legs does a spider have?",
]


@torch.no_grad()
def hf_greedy(hf_model, ids: list[int], n: int) -> list[int]:
    """Plain greedy decoding with HF's KV cache; EOS does not stop it (like ignore_eos)."""
    out = hf_model(torch.tensor([ids]), use_cache=True)
    tokens = []
    for _ in range(n):
        tokens.append(int(out.logits[0, -1].argmax()))
        out = hf_model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens


def test_one_forward_logits_match_hf(llm, hf_model, forward_logits):
    tok = llm.get_tokenizer()
    prompts = [tok.encode(p) for p in RAW_PROMPTS]
    for ids, ours in zip(prompts, forward_logits(llm, prompts)):  # all four in one forward
        with torch.no_grad():
            ref = hf_model(torch.tensor([ids])).logits[0].float()
        rel = (ours - ref).abs().max() / ref.abs().max()
        assert rel < 1e-4, f"relative error {rel:.2e}"
        assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("kind", ["raw", "chat"])
def test_greedy_tokens_equal_hf(llm, hf_model, kind):
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    if kind == "raw":
        outputs = llm.generate(RAW_PROMPTS, params)
    else:
        outputs = llm.chat([[{"role": "user", "content": c}] for c in CHATS], params)
    for out in outputs:
        expected = hf_greedy(hf_model, out.prompt_token_ids, 32)
        assert out.outputs[0].token_ids == expected, out.prompt
        assert out.outputs[0].text == tok.decode(expected, skip_special_tokens=True)
        assert out.outputs[0].finish_reason == "length"


def test_chat_prompt_ids_equal_hf(llm, hf_tokenizer):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=1))[0]
    expected = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(expected, dict) or hasattr(expected, "input_ids"):
        expected = expected["input_ids"]
    assert out.prompt_token_ids == list(expected)
    assert out.prompt == hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def test_capital_of_france(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=30))[0]
    assert out.outputs[0].text == "The capital of France is Paris."
    assert out.outputs[0].finish_reason == "stop"
