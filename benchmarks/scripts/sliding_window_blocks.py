"""KV blocks one long request holds with and without giving back the blocks its sliding
window has passed (scheduler/sliding_window.py): a tiny random Mistral (4 layers, window 64
on every layer, float32 on the CPU), block size 16, one request of 2,000 prompt tokens + 64
generated. "Off" sets the scheduler's window helper to the full-context null object, as a
model with a global layer gets; each runs twice, alternating, and the seconds are CPU wall
time of a model so small that they show the scheduler's overhead. Then the same request
in a pool of 8 blocks (128 tokens). "Most in use" is read right after each schedule, when
the step's chunk holds its blocks.

    PYTHONPATH=. python benchmarks/scripts/sliding_window_blocks.py
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from ember import LLM, SamplingParams
from ember.loader.dummy import iter_dummy_weights
from ember.models.config import ModelConfig
from ember.request import Request
from ember.scheduler.sliding_window import make_window_blocks

WINDOW, BLOCK, PROMPT, OUTPUT = 64, 16, 2000, 64
CONFIG = {
    "architectures": ["MistralForCausalLM"], "model_type": "mistral", "vocab_size": 320, "hidden_size": 64,
    "intermediate_size": 96, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6, "max_position_embeddings": 4096, "rope_theta": 10000.0, "sliding_window": WINDOW,
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "tie_word_embeddings": False,
}


def run(llm: LLM, prompt: list[int], manager: bool) -> dict:
    core = llm.engine
    if not manager:
        core.scheduler.window = make_window_blocks(BLOCK, None)
    req = Request(f"long-{manager}", prompt, SamplingParams(temperature=0, max_tokens=OUTPUT, ignore_eos=True))
    core.add_request(req)
    most_in_use = [0]
    schedule = core.scheduler.schedule

    def schedule_and_read_the_pool():
        out = schedule()
        most_in_use[0] = max(most_in_use[0], core.block_pool.num_in_use)
        return out

    core.scheduler.schedule = schedule_and_read_the_pool
    held, steps, start = 0, 0, time.perf_counter()
    while core.has_unfinished_requests():
        core.step()
        steps += 1
        if not req.status.is_finished:
            held = len(req.block_ids) - req.num_released_blocks  # at its last step before it finishes
    core.check_idle()
    most_in_use = most_in_use[0]
    return {"tokens": req.output_token_ids, "held": held, "most_in_use": most_in_use, "steps": steps,
            "seconds": time.perf_counter() - start, "context": req.num_tokens - 1,
            "kv_bytes": held * core.runner.kv_bytes_per_block(), "preemptions": req.num_preemptions}


def main() -> None:
    path = Path(tempfile.mkdtemp(prefix="swa-mistral-"))
    (path / "config.json").write_text(json.dumps(CONFIG))
    cfg = ModelConfig.from_hf_config(CONFIG)
    save_file({n: t.contiguous() for n, t in iter_dummy_weights(cfg, seed=7)}, str(path / "model.safetensors"))
    prompt = torch.randint(3, 320, (PROMPT,), generator=torch.Generator().manual_seed(0)).tolist()
    results = {}
    for manager in (True, False, True, False):
        llm = LLM(str(path), dtype="float32", block_size=BLOCK, num_kv_blocks=256, max_model_len=2304)
        results[manager] = r = run(llm, prompt, manager)
        print(f"manager {'on ' if manager else 'off'}: context {r['context']} tokens, held at its last step "
              f"{r['held']} blocks ({r['kv_bytes'] / 2**10:.0f} KiB), most in use {r['most_in_use']}, "
              f"{r['steps']} steps, {r['seconds']:.2f} s", flush=True)
    assert results[True]["tokens"] == results[False]["tokens"], "the manager changed the greedy tokens"
    print("greedy tokens identical with and without the manager")

    small = LLM(str(path), dtype="float32", block_size=BLOCK, num_kv_blocks=8, max_model_len=2304)
    r = run(small, prompt, True)
    same = r["tokens"] == results[True]["tokens"]
    print(f"pool of 8 blocks, manager on: ran, held {r['held']}, most in use {r['most_in_use']}, "
          f"{r['steps']} steps, {r['preemptions']} preemptions, tokens identical: {same}")
    try:
        off = LLM(str(path), dtype="float32", block_size=BLOCK, num_kv_blocks=8, max_model_len=2304)
        run(off, prompt, False)
    except ValueError as e:
        print(f"pool of 8 blocks, manager off: refused: {e}")


if __name__ == "__main__":
    main()
