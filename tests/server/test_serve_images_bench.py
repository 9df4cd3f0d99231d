"""The vision race's parts on the CPU: benchmarks/scripts/served_model.py --vl --tiny writes
the Qwen2.5-VL-7B directory's tokenizer, template and processor over tiny sizes (the ids the
7B's config names, every id decoding to text), and `ember bench serve --dataset images` drives
a real `ember serve` of it (dummy weights): every request answered, the server's prompt token
counts those of the template, the image's merged patches and the text; with --shared-image
every request after the first finds the image in the prefix cache."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from servers import MODEL, Server, running

from ember.bench.image_requests import image_requests
from ember.loader.tokenizer_files import load_tokenizer

ROOT = Path(__file__).resolve().parents[2]
SEVEN_B = json.loads((ROOT / "benchmarks" / "configs" / "qwen2.5-vl-7b" / "config.json").read_text())
# the template around one image and a text part: <|im_start|>system\nYou are a helpful
# assistant.<|im_end|>\n<|im_start|>user\n<|vision_start|>, <|vision_end|>, <|im_end|>\n<|im_start|>assistant\n
TEMPLATE_TOKENS = 22
TEXT, OUT, N = 16, 4, 3
WIDTH, HEIGHT = 112, 112  # 8 x 8 patches of 14 pixels
IMAGE_TOKENS = 16  # merged 2 x 2


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("qwen2.5-vl-tiny")
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "scripts" / "served_model.py"), "--vl", "--tiny", str(out)],
                   check=True, env=os.environ | {"PYTHONPATH": str(ROOT)})
    return out


def test_the_tiny_directory_keeps_the_7bs_ids_template_and_processor(vl_dir):
    config = json.loads((vl_dir / "config.json").read_text())
    same = [k for k in SEVEN_B if k not in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                             "num_attention_heads", "num_key_value_heads", "max_window_layers",
                                             "rope_scaling", "vision_config")]
    assert {k: config[k] for k in same} == {k: SEVEN_B[k] for k in same}
    assert json.loads((vl_dir / "preprocessor_config.json").read_text())["max_pixels"] == 12845056
    tok = load_tokenizer(vl_dir)
    assert tok.vocab_size == 152064
    assert tok.encode("<|vision_start|><|image_pad|><|vision_end|><|im_end|>", add_special_tokens=False) == [
        151652, 151655, 151653, 151645]
    specials = set(range(151643, 151665))
    assert set(tok.all_special_ids) >= specials
    assert all(tok.decode([i], skip_special_tokens=True) for i in range(152064) if i not in specials)
    text = tok.apply_chat_template([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}},
                                                                  {"type": "text", "text": "Hi"}]}],
                                   add_generation_prompt=True)
    assert text == ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
                    "<|vision_start|><|image_pad|><|vision_end|>Hi<|im_end|>\n<|im_start|>assistant\n")
    assert len(tok.encode(text, add_special_tokens=False)) == TEMPLATE_TOKENS + 2


def test_image_requests_are_seeded_and_share_the_image_only_when_asked(vl_dir):
    from PIL import Image

    tok = load_tokenizer(vl_dir)
    distinct = image_requests(N, TEXT, OUT, WIDTH, HEIGHT, tok, seed=5)
    assert distinct == image_requests(N, TEXT, OUT, WIDTH, HEIGHT, tok, seed=5)
    urls = [r.messages[0]["content"][0]["image_url"]["url"] for r in distinct]
    assert len(set(urls)) == N and all(u.startswith("data:image/jpeg;base64,") for u in urls)
    assert [(r.prompt_len, r.output_len) for r in distinct] == [(TEXT, OUT)] * N
    assert all(len(tok.encode(r.messages[0]["content"][1]["text"], add_special_tokens=False)) == TEXT for r in distinct)
    shared = image_requests(N, TEXT, OUT, WIDTH, HEIGHT, tok, seed=5, shared_image=True, fmt="png")
    shared_urls = {r.messages[0]["content"][0]["image_url"]["url"] for r in shared}
    assert len(shared_urls) == 1
    import base64
    import io

    png = Image.open(io.BytesIO(base64.b64decode(shared_urls.pop().split(",", 1)[1])))
    assert png.size == (WIDTH, HEIGHT)
    # PNG is lossless: the pixels are the seed's draw
    want = np.random.default_rng([5, 0, 0]).integers(0, 256, (HEIGHT, WIDTH, 3), dtype=np.uint8)
    assert np.array_equal(np.asarray(png), want)
    assert image_requests(N, TEXT, OUT, WIDTH, HEIGHT, tok, seed=6) != distinct


@pytest.fixture(scope="module")
def vl_server(vl_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("vl-server") / "server.log"
    yield from running(Server(vl_dir, log, "--load-format", "dummy", "--seed", "0", "--max-model-len", "2048",
                              "--limit-mm-per-prompt", '{"image": 1, "video": 0}'))


@pytest.mark.parametrize("shared", [False, True], ids=["distinct-images", "shared-image"])
def test_bench_serve_sends_images_to_a_real_server(vl_server, vl_dir, tmp_path, capsys, shared):
    from ember.server.cli import main

    # another image first: the template's tokens before any image are cached from here on
    warm = image_requests(1, TEXT, OUT, WIDTH, HEIGHT, load_tokenizer(vl_dir), seed=99)[0]
    vl_server.client().chat.completions.create(model=MODEL, messages=warm.messages, max_tokens=1)
    out_json = tmp_path / "images.json"
    before = vl_server.wait_idle()
    main(["bench", "serve", "--base-url", vl_server.url, "--tokenizer", str(vl_dir), "--dataset", "images",
          "--num-prompts", str(N), "--image-width", str(WIDTH), "--image-height", str(HEIGHT),
          "--random-input-len", str(TEXT), "--random-output-len", str(OUT), "--ignore-eos", "--max-concurrency", "1",
          "--seed", "2" if shared else "1", "--output-json", str(out_json), *(["--shared-image"] if shared else [])])
    printed = capsys.readouterr().out
    per_request = TEMPLATE_TOKENS + IMAGE_TOKENS + TEXT
    assert re.search(rf"Prompt tokens, the server's count:\s+{N * per_request}\n", printed)
    result = json.loads(out_json.read_text())["results"]
    assert (result["completed"], result["failed"], result["total_input_tokens"], result["total_output_tokens"]) == (
        N, 0, N * TEXT, N * OUT)
    assert 0 < result["median_ttft_ms"] <= result["p99_ttft_ms"] and result["output_throughput"] > 0
    after = vl_server.wait_idle()
    assert after["prompt_tokens_total"] - before["prompt_tokens_total"] == N * per_request
    # one at a time: each request finds the template's 15 tokens before the image (through
    # <|vision_start|>); with the image shared, each after the first also its 16 tokens and <|vision_end|>
    hits = after["prefix_cache_hits_total"] - before["prefix_cache_hits_total"]
    assert hits == 15 * N + ((IMAGE_TOKENS + 1) * (N - 1) if shared else 0)
