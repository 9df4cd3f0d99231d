"""`ember bench throughput` run in-process through `ember.server.cli.main` on a tiny workload
with the real SmolLM2 model, and the random dataset on its own. (`--compare hf` is run by
hand: too slow for the suite.)"""

from __future__ import annotations

import json
import re

import pytest

from ember.bench.throughput import random_requests
from ember.server.cli import main

TINY = ["bench", "throughput", "--num-prompts", "3", "--input-len", "8", "--output-len", "4",
        "--num-kv-blocks", "64", "--max-model-len", "128"]
THROUGHPUT_LINE = re.compile(
    r"^Throughput: \d+\.\d{2} requests/s, \d+\.\d{2} total tokens/s, \d+\.\d{2} output tokens/s$", re.M
)


def totals(out: str) -> tuple[int, int]:
    prompt = re.search(r"^Total num prompt tokens:  (\d+)$", out, re.M)
    output = re.search(r"^Total num output tokens:  (\d+)$", out, re.M)
    assert prompt and output, out
    return int(prompt.group(1)), int(output.group(1))


def test_fixed_lengths_and_json(gguf_path, tmp_path, capsys):
    path = tmp_path / "out" / "tp.json"
    main([*TINY, str(gguf_path), "--output-json", str(path)])
    out = capsys.readouterr().out
    assert len(THROUGHPUT_LINE.findall(out)) == 1, out
    assert totals(out) == (24, 12)  # 3 x 8 prompt tokens, 3 x 4 output tokens (ignore_eos)

    report = json.loads(path.read_text())
    assert set(report) == {"config", "engine", "date", "machine", "results"}
    assert report["config"]["num_prompts"] == 3 and report["config"]["input_len"] == 8
    assert report["engine"]["max_model_len"] == 128 and report["engine"]["num_kv_blocks"] == 64
    assert report["engine"]["kv_cache_dtype"] == "float16"  # auto with GGUF blocks on the CPU: llama.cpp's default
    assert {"platform", "cpu_count", "torch", "device"} <= set(report["machine"])
    ember = report["results"]["ember"]
    assert (ember["num_requests"], ember["prompt_tokens"], ember["output_tokens"]) == (3, 24, 12)
    assert ember["output_tokens_per_s"] == pytest.approx(12 / ember["elapsed_s"])
    assert (ember["preemptions"], ember["preemptions_by_swap"]) == (0, 0)
    assert "hf" not in report["results"]


def test_fp8_kv_cache_flag(gguf_path, tmp_path, capsys):
    path = tmp_path / "fp8.json"
    main([*TINY, str(gguf_path), "--kv-cache-dtype", "fp8", "--output-json", str(path)])
    out = capsys.readouterr().out
    assert totals(out) == (24, 12)
    assert "KV cache: 64 blocks, 0.01 GiB; preemptions: 0" in out
    report = json.loads(path.read_text())
    assert report["config"]["kv_cache_dtype"] == report["engine"]["kv_cache_dtype"] == "fp8"
    # 64 blocks x 16 tokens x 30 layers x K|V x 3 KV heads x 64 dims x 1 byte
    assert report["results"]["ember"]["memory_gib"]["kv_cache"] * 2**30 == 64 * 16 * 30 * 2 * 3 * 64


def test_preemptions_by_swap_are_counted(gguf_path, tmp_path, capsys):
    # three requests that grow to 6 blocks of 16 on a pool of 14 (tests/engine/test_swap.py's sizes)
    path = tmp_path / "swap.json"
    main(["bench", "throughput", "--num-prompts", "3", "--input-len", "60", "--output-len", "30", "--num-kv-blocks",
          "14", "--max-model-len", "96", "--preemption-mode", "swap", "--swap-space", "0.01", str(gguf_path),
          "--output-json", str(path)])
    ember = json.loads(path.read_text())["results"]["ember"]
    n = ember["preemptions"]
    assert n > 0 and ember["preemptions_by_swap"] == n
    assert f"KV cache: 14 blocks, 0.00 GiB; preemptions: {n} ({n} by swap)" in capsys.readouterr().out


def test_range_ratio_is_seeded(gguf_path, capsys):
    main([*TINY, str(gguf_path), "--range-ratio", "0.5", "--seed", "1"])
    # input lengths in [4, 12], output lengths in [2, 6]; recorded once for seed 1
    assert totals(capsys.readouterr().out) == (26, 10)


def test_random_requests_bounds_and_special_ids():
    special = list(range(17))
    reqs = random_requests(200, 64, 128, 0.25, 49152, special, seed=3)
    assert all(48 <= len(r.prompt_token_ids) <= 80 and 96 <= r.output_len <= 160 for r in reqs)
    assert not {t for r in reqs for t in r.prompt_token_ids} & set(special)
    assert reqs == random_requests(200, 64, 128, 0.25, 49152, special, seed=3)
    assert reqs != random_requests(200, 64, 128, 0.25, 49152, special, seed=4)
    fixed = random_requests(5, 8, 4, 0.0, 49152, special, seed=0)
    assert [(len(r.prompt_token_ids), r.output_len) for r in fixed] == [(8, 4)] * 5


def test_bad_range_ratio_is_refused():
    with pytest.raises(ValueError, match="range-ratio"):
        random_requests(1, 8, 4, 1.0, 100, [], seed=0)


def test_fp8_weights_flag_on_dummy_weights(tmp_path, capsys):
    """--quantization fp8 with --load-format dummy (how the GPU benchmarks run it), here on a
    tiny config on the CPU: every linear layer quantized at load, named in the report."""
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256, "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(config))
    path = tmp_path / "fp8.json"
    main([*TINY, str(tmp_path), "--load-format", "dummy", "--quantization", "fp8", "--dtype", "float32",
          "--output-json", str(path)])
    out = capsys.readouterr().out
    assert totals(out) == (24, 12) and "float32, fp8 weights, cpu)" in out, out
    report = json.loads(path.read_text())
    assert report["config"]["quantization"] == report["engine"]["quantization"] == "fp8"
    # fp8 linear layers (1 byte a weight, 4 a row's scale) beside the float32 embedding and head
    linear = 2 * (64 * 128 + 64 * 64 + 2 * 128 * 64 + 64 * 128)
    rows = 2 * (128 + 64 + 256 + 64)
    dense = 4 * (2 * 256 * 64 + 5 * 64)  # float32 embedding, head and norms
    assert report["results"]["ember"]["memory_gib"]["weights"] * 2**30 == linear + 4 * rows + dense
