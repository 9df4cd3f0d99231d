"""`ember bench throughput --structured-output json`: the free and the JSON-constrained run
of the same prompts, back to back, with the same token counts and their ratio."""

from __future__ import annotations

import json
import re

import pytest

from ember.server.cli import main

TINY = ["bench", "throughput", "--num-prompts", "3", "--input-len", "8", "--output-len", "4",
        "--num-kv-blocks", "64", "--max-model-len", "128", "--structured-output", "json"]


def test_free_and_json_runs_back_to_back(gguf_path, tmp_path, capsys):
    # (--no-jump-forward: tests/engine/test_structured_e2e.py checks that nothing is forced)
    path = tmp_path / "tp.json"
    forced = 9
    main([*TINY, str(gguf_path), "--output-json", str(path)])
    out = capsys.readouterr().out
    assert len(re.findall(r"^Total num output tokens:  12$", out, re.M)) == 2, out
    # jump-forward: each request starts with `{"records": [{"id": ` forced, of which the
    # first 3 tokens fit before max_tokens=4 (one token is always left to sample)
    assert f"Output tokens appended by jump-forward:  {forced}" in out
    results = json.loads(path.read_text())["results"]
    free, constrained = results["ember"], results["ember_json"]
    assert (free["output_tokens"], constrained["output_tokens"], constrained["forced_tokens"]) == (12, 12, forced)
    assert results["json_over_free_output_tok_s"] == pytest.approx(
        constrained["output_tokens_per_s"] / free["output_tokens_per_s"])
    assert re.search(r"^json/free output tok/s = \d+\.\d\d$", out, re.M)
