"""ember.lang's programs on the default model, in-process (LocalBackend on an LLM) and, with
--url, over HTTP (RuntimeEndpoint on an `ember serve`): wall time, engine calls, prompt
tokens sent and found cached, per arm.

  fork-join      a shared prefix, fork(4) x --tokens tokens each, join; against the same four
                 gens run one after another (each its own program on the prefix)
  few-shot       select among 4 labels after a ~1,000-token shared few-shot prefix, --items
                 items through run_batch; against the same prompts scored one by one
  multi-turn     --chats conversations x 4 turns: the share of each turn's history (turns
                 2-4) found in the prefix cache
  json           --items records extracted as JSON: one gen(json_schema) against a var_scope
                 of one regex gen a field (every output parsed and checked)

    python benchmarks/scripts/frontend_bench.py [--url http://127.0.0.1:8000 --api-key K]
"""

from __future__ import annotations

import argparse
import json
import time

import ember.lang as sgl

LABELS = ["positive", "negative", "neutral", "mixed"]
REVIEWS = ["The food was great and the staff were kind.", "Cold soup, rude waiter, never again.",
           "It was a restaurant. We ate there.", "Lovely view, but the wait was far too long."]


def few_shot_prefix(target_tokens: int = 1000) -> str:
    lines = ["Classify each review as positive, negative, neutral or mixed.\n"]
    i = 0
    while len(" ".join(lines)) < target_tokens * 4:  # ~4 characters a token
        lines.append(f"Review: {REVIEWS[i % 4]} (#{i})\nLabel: {LABELS[i % 4]}\n")
        i += 1
    return "".join(lines)


@sgl.function
def fork_join(s, prefix, tokens):
    s += prefix
    forks = s.fork(4)
    forks += lambda i: f"\nPoint {i + 1}:" + sgl.gen("point", max_tokens=tokens, temperature=0, ignore_eos=True)
    forks.join()
    return forks.states  # their calls' counts


@sgl.function
def one_point(s, prefix, i, tokens):
    s += prefix + f"\nPoint {i + 1}:" + sgl.gen("point", max_tokens=tokens, temperature=0, ignore_eos=True)


@sgl.function
def classify(s, prefix, review):
    s += prefix + f"Review: {review}\nLabel: " + sgl.select("label", choices=LABELS)


@sgl.function
def chat(s, topic):
    for i, ask in enumerate((f"Tell me about {topic}.", "Why?", "Give an example.", "Summarize.")):
        s += sgl.user(ask)
        s += sgl.assistant(sgl.gen(f"turn{i}", max_tokens=24, temperature=0))


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                          "age": {"type": "integer"}, "city": {"type": "string", "maxLength": 20}},
          "required": ["name", "age", "city"], "additionalProperties": False}
PEOPLE = ["Ada Lovelace, 36, lived in London.", "Alan Turing, 41, worked in Manchester.",
          "Grace Hopper, 85, was born in New York.", "Edsger Dijkstra, 72, taught in Austin."]


@sgl.function
def extract_schema(s, text):
    s += f"Text: {text}\nThe person as JSON: " + sgl.gen("json", max_tokens=48, temperature=0, json_schema=PERSON)


@sgl.function
def extract_fields(s, text):
    s += f"Text: {text}\nThe person as JSON: "
    with s.var_scope("json"):
        s += '{"name": "' + sgl.gen("name", max_tokens=12, temperature=0, regex=r"[A-Za-z .]{1,20}") + '", '
        s += '"age": ' + sgl.gen("age", max_tokens=4, temperature=0, regex=r"[0-9]{1,3}") + ", "
        s += '"city": "' + sgl.gen("city", max_tokens=12, temperature=0, regex=r"[A-Za-z .]{1,20}") + '"}'


def counts(states, names) -> tuple[int, int]:
    """Prompt tokens sent and found cached, over the states' model calls of `names`."""
    sent = cached = 0
    for state in states:
        executor = state.stream_executor
        for name in names:
            meta = executor.meta_info.get(name)
            if meta is None:
                continue
            prompt, hit = meta["prompt_tokens"], meta["cached_tokens"]
            sent += sum(prompt) if isinstance(prompt, list) else prompt
            cached += sum(hit) if isinstance(hit, list) else hit
    return sent, cached


def arm(name: str, backend, run) -> dict:
    backend.flush_cache()
    calls = backend.num_engine_calls
    start = time.perf_counter()
    states, names = run()
    wall = time.perf_counter() - start
    sent, cached = counts(states, names)
    row = {"arm": name, "wall_s": round(wall, 3), "engine_calls": backend.num_engine_calls - calls,
           "prompt_tokens": sent, "cached_tokens": cached, "hit_rate": round(cached / sent, 3) if sent else None}
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a .gguf or HF directory (default: the default model)")
    ap.add_argument("--url", default=None, help="also run over HTTP against this `ember serve`")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--items", type=int, default=16)
    ap.add_argument("--chats", type=int, default=8)
    args = ap.parse_args()
    backends = []
    if args.url is None:
        from ember import LLM

        backends.append(("in-process", sgl.LocalBackend(LLM(args.model))))
    else:
        backends.append(("http", sgl.RuntimeEndpoint(args.url, api_key=args.api_key)))
    prefix = few_shot_prefix(200) + "Here are four short points about keeping a garden healthy."
    shots = few_shot_prefix()
    items = [{"prefix": shots, "review": f"{REVIEWS[i % 4]} (item {i})"} for i in range(args.items)]
    for where, backend in backends:
        one_point.run(prefix, 0, 2, backend=backend)  # the first request's one-time costs stay out of the timings
        print(f"# {where}", flush=True)
        arm("fork-join: fork(4)", backend,
            lambda: (fork_join.run(prefix, args.tokens, backend=backend).ret_value, ["point"]))
        arm("fork-join: 4 gens in sequence", backend,
            lambda: ([one_point.run(prefix, i, args.tokens, backend=backend) for i in range(4)], ["point"]))
        arm("few-shot select: run_batch", backend,
            lambda: (classify.run_batch(items, backend=backend), ["label"]))
        arm("few-shot select: one by one", backend,
            lambda: ([classify.run(backend=backend, **item) for item in items], ["label"]))
        states: list = []

        def turns():
            states.extend(chat.run_batch([{"topic": f"topic {i}"} for i in range(args.chats)], backend=backend))
            return states, ["turn0", "turn1", "turn2", "turn3"]

        arm("multi-turn: run_batch", backend, turns)
        people = [{"text": PEOPLE[i % 4]} for i in range(args.items)]
        for label, program, names in (("json: one gen(json_schema)", extract_schema, ["json"]),
                                      ("json: var_scope of 3 regex gens", extract_fields, ["name", "age", "city"])):
            done: list = []
            arm(label, backend, lambda: (done.extend(program.run_batch(people, backend=backend)) or done, names))
            parsed = [json.loads(state["json"]) for state in done]
            assert all(set(p) == {"name", "age", "city"} and isinstance(p["age"], int) for p in parsed), parsed
        history = reused = 0  # each of turns 2-4: the earlier turns' tokens, and those found cached
        for state in states:
            for i in (1, 2, 3):
                before, meta = state.get_meta_info(f"turn{i - 1}"), state.get_meta_info(f"turn{i}")
                history += before["prompt_tokens"] + before["completion_tokens"]
                reused += meta["cached_tokens"]
        print(json.dumps({"arm": "multi-turn: turns 2-4, history tokens found cached", "share":
                          round(reused / history, 3)}))


if __name__ == "__main__":
    main()
