"""The default model run as it is stored (GGUF Q4_1 blocks, int8 activations: ember's default
on the CPU) against llama.cpp's own greedy output on the same file, recorded in
data/llama_cpp_greedy.json by llama_cpp_reference.py (so that CI needs no llama.cpp build),
and against the dequantized float32 path: perplexity, memory.

Agreement is counted with llama.cpp's tokens as the context (teacher forcing): at each of the
10 x 64 positions, ember's argmax given llama.cpp's text so far must be llama.cpp's next token.
Free-running sequences part at the first near-tie and then say nothing more about the kernels.
llama.cpp ran with ignore_eos, which pushes its end-of-generation tokens out of the argmax;
ember's are pushed out alike.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import pytest
import torch

from ember import LLM
from ember.layers.linear import Linear
from ember.layers.quant.gguf_blocks import GGUFBlocks
from ember.loader.default_model import cache_dir

pytestmark = pytest.mark.slow

RECORD = json.loads((Path(__file__).with_name("data") / "llama_cpp_greedy.json").read_text())

TEXT = (
    "The river begins in the hills above the town, where a dozen small streams run together "
    "between stones and ferns. In spring the water is cold and loud, and the children who live "
    "nearby are told to keep away from the banks. By midsummer it has slowed to a quiet brown "
    "current that turns the old mill wheel only when the wind comes from the west. The mill has "
    "not ground any grain for forty years. Its owner, a retired teacher, keeps the machinery oiled "
    "because she likes the sound it makes, and on Saturdays she lets visitors climb the narrow "
    "stairs to see the gears. Most of them are surprised by how simple the mechanism is: a shaft, "
    "a few wooden cogs, two heavy stones. She explains that the hard part was never the machine "
    "but the water, which had to be managed with dams, channels and sluices, and argued over with "
    "neighbours for generations. Records from the parish show disputes about the river going back "
    "three hundred years. Farmers downstream complained that the mill took too much water in dry "
    "seasons; the miller complained that they diverted it to their fields at night. Courts were "
    "asked to decide how many hours each party could open its gates. Today the arguments are about "
    "fish, flooding and footpaths, but the town still meets every autumn to discuss the river, and "
    "the meeting still begins with a reading of the oldest agreement, written in a careful hand on "
    "a sheet of paper that is kept in a glass case at the library."
)


@pytest.fixture(scope="module")
def quantized(gguf_path):
    llm = LLM(str(gguf_path), num_kv_blocks=192)  # the defaults: GGUF blocks on the CPU, float32
    assert (llm.config.quantization, llm.config.dtype) == ("gguf", "float32")
    return llm


def _file(name: str) -> Path | None:
    """The recorded file where it is here and unchanged (the K-quant files exist where
    llama_cpp_reference.py made them with llama.cpp's llama-quantize)."""
    entry = RECORD["files"][name]
    path = cache_dir() / "models" / entry["file"]
    if not path.is_file():
        return None
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert digest == entry["sha256"], f"{path} is not the file llama.cpp's tokens were recorded on"
    return path


def teacher_forced_agreement(llm: LLM, forward_logits, tokens: list[list[int]]) -> float:
    prompts = RECORD["prompt_token_ids"]
    end = sorted(llm.get_tokenizer().eos_token_ids)
    assert end == [0, 2, 4]  # the end-of-generation ids llama.cpp lists for this vocabulary
    agree = total = 0
    logits = forward_logits(llm, [p + t for p, t in zip(prompts, tokens)])
    for p, t, lg in zip(prompts, tokens, logits):
        lg = lg.clone()
        lg[:, end] = float("-inf")
        ours = lg[len(p) - 1: len(p) - 1 + len(t)].argmax(-1).tolist()
        agree += sum(a == b for a, b in zip(ours, t))
        total += len(t)
    assert total == 10 * RECORD["max_tokens"]
    return agree / total


def test_the_record_is_of_these_prompts(quantized):
    tok = quantized.get_tokenizer()
    assert [tok.encode(p) for p in RECORD["prompts"]] == RECORD["prompt_token_ids"]
    assert _file("Q4_1") is not None  # the default model is always here


def test_every_linear_layer_runs_on_gguf_blocks(quantized, gguf_path):
    model = quantized.engine.runner.model
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    assert len(layers) == 30 * 4
    assert all(isinstance(m.format, GGUFBlocks) and m.format.type_name == "Q4_1" for m in layers)
    assert model.model.embed_tokens.blocks.type_name == "Q8_0"  # tied: the head multiplies it too
    runner = quantized.engine.runner
    # resident weights: the file's bytes (q|k|v and gate|up stacked), norms in float32
    assert runner.weight_bytes <= 1.15 * runner.file_tensor_bytes
    assert runner.file_tensor_bytes == 96_576_768


@pytest.mark.parametrize("name", sorted(RECORD["files"]))
def test_greedy_agrees_with_llama_cpp(name, gguf_path, quantized, forward_logits):
    path = _file(name)
    if path is None:
        pytest.skip(f"{RECORD['files'][name]['file']} is not here (llama_cpp_reference.py makes it)")
    llm = quantized if path == gguf_path else LLM(str(path), num_kv_blocks=192)
    agreement = teacher_forced_agreement(llm, forward_logits, RECORD["files"][name]["tokens"])
    assert agreement >= 0.95, f"{name}: {agreement:.3f} of positions agree with llama.cpp"


def test_the_record_is_llama_cpp_s_output(gguf_path, llama_greedy):
    """Where the peer is built, llama.cpp gives today what the record says (two prompts)."""
    got = llama_greedy(gguf_path, RECORD["prompt_token_ids"][:2], RECORD["max_tokens"], 1024, ignore_eos=True)
    assert got.tokens == RECORD["files"]["Q4_1"]["tokens"][:2]


def perplexity(llm: LLM, forward_logits) -> float:
    ids = llm.get_tokenizer().encode(TEXT)
    logits = forward_logits(llm, [ids])[0]
    nll = torch.nn.functional.cross_entropy(logits[:-1].float(), torch.tensor(ids[1:]))
    return math.exp(nll.item())


def test_perplexity_within_one_percent_of_the_dequantized_path(quantized, llm, forward_logits):
    ours, exact = perplexity(quantized, forward_logits), perplexity(llm, forward_logits)
    assert len(quantized.get_tokenizer().encode(TEXT)) > 256
    assert 5 < exact < 50  # a real model on real text
    assert abs(ours / exact - 1) < 0.01, (ours, exact)
