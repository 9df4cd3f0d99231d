"""`ember bench frontend` through `ember.server.cli.main` on a tiny instance of its four
programs: in-process (the default model in float32, as the main server), over HTTP and as
openai client calls against the main server."""

from __future__ import annotations

import json

import pytest

from ember.server.cli import main

pytestmark = pytest.mark.usefixtures("still_serving")

TINY = ["--docs", "1", "--tokens", "4", "--items", "2", "--prefix-tokens", "200", "--chats", "2",
        "--turn-tokens", "4", "--records", "2"]


def test_the_three_arms_of_the_four_programs(server, gguf_path, tmp_path, capsys):
    from servers import KEY

    out = tmp_path / "rows.json"
    main(["bench", "frontend", str(gguf_path), "--dtype", "float32", "--quantization", "none", "--url", server.url,
          "--api-key", KEY, *TINY, "--out", str(out)])
    rows = {(r["program"], r["arm"], r["variant"]): r for r in json.loads(out.read_text())["rows"]}
    assert "| few-shot | in-process | select |" in capsys.readouterr().out
    by_arm = {arm: {k[0] + "/" + k[2]: r for k, r in rows.items() if k[1] == arm} for arm in ("in-process", "http")}
    # the same token-exact calls on the same engine, in-process or over HTTP; what they compute
    # differs only by the partial blocks a request finds cached or not, as calls finish sooner or later
    assert {k: (r["requests"], r["prompt_tokens"]) for k, r in by_arm["in-process"].items()} == \
        {k: (r["requests"], r["prompt_tokens"]) for k, r in by_arm["http"].items()}
    for k, r in by_arm["in-process"].items():
        assert abs(r["computed_tokens"] - by_arm["http"][k]["computed_tokens"]) < r["requests"] * 16, k
    requests = {k: r["requests"] for k, r in rows.items() if k[1] != "http"}
    assert requests == {
        ("fork-join", "in-process", "outline, fork(4), join, summary"): 6,  # outline, 4 expansions, summary
        ("few-shot", "in-process", "select"): 8,  # one a label an item
        ("multi-turn", "in-process", "4 turns"): 8,
        ("json", "in-process", "one gen(json_schema)"): 2,
        ("json", "in-process", "var_scope of 3 regex gens"): 6,
        ("fork-join", "openai", "outline, 4 expansions, summary: one call at a time"): 6,
        ("few-shot", "openai", "each label scored (echo + logprobs)"): 8,
        ("few-shot", "openai", "one guided_choice completion an item"): 2,
        ("multi-turn", "openai", "4 turns: chat completions"): 8,
        ("json", "openai", "guided_json completion"): 2,
        ("json", "openai", "3 guided_regex completions"): 6,
    }
    scored = rows[("few-shot", "openai", "each label scored (echo + logprobs)")]
    assert scored["computed_tokens"] == scored["prompt_tokens"]  # prompt logprobs from 0: nothing from the cache
    # select computes the shared prefix once, not once a label (4 of the 8 openai calls' worth)
    assert rows[("few-shot", "in-process", "select")]["computed_tokens"] < scored["computed_tokens"] / 4
    for arm in ("in-process", "openai"):
        variant = "4 turns" if arm == "in-process" else "4 turns: chat completions"
        assert 0.5 < rows[("multi-turn", arm, variant)]["history_reuse"] <= 1
