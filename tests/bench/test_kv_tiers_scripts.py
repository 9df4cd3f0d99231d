"""The device's issue #40 benchmarks (h200.sh kv-tiers), run here on the default model at tiny
sizes so they cannot rot: benchmarks/scripts/multiturn.py's client against `ember serve` with a
host tier under a pool of 7 blocks (a returning conversation gets its evicted history back from
host memory, as /metrics counts), and beam_bench.py's sequences against LLM.beam_search's."""

from __future__ import annotations

import json
import os
import runpy
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from ember import LLM, BeamSearchParams
from ember.bench.throughput import random_requests

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "benchmarks" / "scripts"


def script(name: str, *args: str) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, str(SCRIPTS / name), *args], capture_output=True, text=True, timeout=120,
                          env=os.environ | {"PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def test_multiturn_returning_turns_hit_the_host_tier(gguf_path, tmp_path):
    pytest.importorskip("fastapi")
    pytest.importorskip("aiohttp")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # 3 conversations x 2 turns: a 16-token system prompt, 40 new ids a turn, 8 out; turn 1 of the
    # third pushes the first's blocks out of the 7-block (112-token) pool into the tier
    script("multiturn.py", str(gguf_path), "--out", str(tmp_path), "--arms", "ember-tier", "--load-format", "auto",
           "--num-prompts", "3", "--num-turns", "2", "--shared-prefix-len", "16", "--turn-input-len", "40",
           "--random-output-len", "8", "--concurrency", "1", "--pool-tokens", "112", "--ember-block-size", "16",
           "--tier-gib", "0.1", "--max-model-len", "112", "--port", str(port), "--deadline", "90")
    (row,) = json.loads((tmp_path / "multiturn.json").read_text())
    assert (row["arm"], row["flags"], row["completed"], row["failed"]) == (
        "ember-tier", "--num-kv-blocks 7 --kv-offload-gib 0.1", 6, 0)
    # turn 2's prompts hold turn 1's prompt (56), its 8 streamed answer ids and 40 new ones
    assert row["prompt_tokens"] == 3 * 56 + 3 * (56 + 8 + 40)
    m = row["metrics"]
    hits = m["ember:kv_offload_hits_total"]
    assert hits >= 16 and hits % 16 == 0 and m["ember:prefix_cache_hits_total"] >= hits
    assert m['ember:kv_offload_bytes_total{direction="to_device"}'] > 0
    assert m["ember:kv_offload_load_seconds_count"] > 0 and m["ember:kv_offload_load_seconds_sum"] > 0
    assert row["ttft_p50_ms_returning"] > 0 and row["ttft_p50_ms_first"] > 0


def test_beam_bench_gives_beam_searchs_sequences(gguf_path, tmp_path, monkeypatch, capsys):
    out = tmp_path / "beam.json"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # what vllm_race.py, which it imports, sets
    monkeypatch.syspath_prepend(str(SCRIPTS))
    monkeypatch.setattr(sys, "argv", ["beam_bench.py", str(gguf_path), "--load-format", "auto", "--num-prompts", "2",
                                      "--input-len", "16", "--output-len", "4", "--beam-width", "2",
                                      "--output-json", str(out), "--profile", str(tmp_path / "profile.txt")])
    runpy.run_path(str(SCRIPTS / "beam_bench.py"), run_name="__main__")  # in this process: no second start-up
    got = json.loads(out.read_text())
    assert capsys.readouterr().out.count("RESULT ") == 1 and got["sequence_tokens"] == 2 * 2 * 4
    assert "beam_search" in (tmp_path / "profile.txt").read_text(), "the profiled run's calls"
    llm = LLM(str(gguf_path), seed=0, max_model_len=2048, max_num_seqs=512, max_num_batched_tokens=16384)
    prompts = random_requests(2, 16, 4, 0.0, llm.config.model_config.vocab_size, [], seed=0)
    want = llm.beam_search([{"prompt_token_ids": r.prompt_token_ids} for r in prompts],
                           BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True))
    assert got["sequences"] == [[s.tokens for s in o.sequences] for o in want]
