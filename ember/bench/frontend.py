"""`ember bench frontend`: issue #41's four ember.lang programs in three arms, so the frontend's
worth is measured against what a user writes without one.

Programs (each arm runs the same inputs, greedy):
  fork-join   summarize --docs documents: an outline, fork(4) expansions of it, joined, then a
              one-line summary (--tokens tokens each gen)
  few-shot    classify --items reviews with select among 4 labels after a shared few-shot
              prefix of ~--prefix-tokens tokens
  multi-turn  --chats conversations x 4 turns of --turn-tokens tokens; also the share of turns
              2-4's history found in the prefix cache
  json        --records people extracted as JSON: one gen(json_schema), and a var_scope of one
              regex gen a field (every output parsed and checked)

Arms:
  in-process  ember.lang on LocalBackend(LLM(...)): programs through run_batch
  http        ember.lang on RuntimeEndpoint(--url, or an `ember serve` this command starts)
  openai      the programs' calls sent one by one with the `openai` client to that server's
              OpenAI API: completions (select: each label scored with echo + logprobs; also
              one guided_choice completion an item), chat completions for the turns

Each row: wall time, engine requests, prompt tokens sent (looked up in the prefix cache at
admission) and computed (sent less found cached), and the hit rate, from the engine's own
counters (in-process) or the server's /metrics. The prefix cache is emptied before each row.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ember.lang as sgl

ARMS = ("in-process", "http", "openai")
PROGRAMS = ("fork-join", "few-shot", "multi-turn", "json")

LABELS = ["positive", "negative", "neutral", "mixed"]
REVIEWS = ["The food was great and the staff were kind.", "Cold soup, rude waiter, never again.",
           "It was a restaurant. We ate there.", "Lovely view, but the wait was far too long."]
TOPICS = ["gardens", "rivers", "bread", "bicycles", "owls", "tea", "maps", "clocks"]
ASKS = ("Tell me about {topic}.", "Why does that matter?", "Give an example.", "Summarize it in a line.")
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                          "age": {"type": "integer"}, "city": {"type": "string", "maxLength": 20}},
          "required": ["name", "age", "city"], "additionalProperties": False}
PEOPLE = ["Ada Lovelace, 36, lived in London.", "Alan Turing, 41, worked in Manchester.",
          "Grace Hopper, 85, was born in New York.", "Edsger Dijkstra, 72, taught in Austin."]
WARM_RECORD = "Nobody, 1, lived nowhere."
FIELDS = (('{"name": "', "name", 12, r"[A-Za-z .]{1,20}"), ('", "age": ', "age", 4, r"[0-9]{1,3}"),
          (', "city": "', "city", 12, r"[A-Za-z .]{1,20}"))


def few_shot_prefix(target_tokens: int) -> str:
    """Labelled reviews, about `target_tokens` tokens (~4 characters a token)."""
    lines = ["Classify each review as positive, negative, neutral or mixed.\n"]
    i = 0
    while len("".join(lines)) < target_tokens * 4:
        lines.append(f"Review: {REVIEWS[i % 4]} (#{i})\nLabel: {LABELS[i % 4]}\n")
        i += 1
    return "".join(lines)


def document(i: int) -> str:
    return (f"Document {i}. " + few_shot_prefix(160).replace("Classify each review", "Here are reviews")
            + "Write about what these reviews say.")


# ---- the programs -------------------------------------------------------------------------

@sgl.function
def summarize(s, doc, tokens):
    s += doc + "\nAn outline in four points:" + sgl.gen("outline", max_tokens=tokens, temperature=0, ignore_eos=True)
    forks = s.fork(4)
    forks += lambda i: f"\nPoint {i + 1} in detail:" + sgl.gen("detail", max_tokens=tokens, temperature=0,
                                                               ignore_eos=True)
    forks.join("concate_and_append")
    s += "\nIn one sentence:" + sgl.gen("summary", max_tokens=tokens, temperature=0, ignore_eos=True)


@sgl.function
def classify(s, prefix, review):
    s += prefix + f"Review: {review}\nLabel: " + sgl.select("label", choices=LABELS)


@sgl.function
def chat(s, topic, tokens):
    for i, ask in enumerate(ASKS):
        s += sgl.user(ask.format(topic=topic))
        s += sgl.assistant(sgl.gen(f"turn{i}", max_tokens=tokens, temperature=0))


@sgl.function
def extract_schema(s, text):
    s += f"Text: {text}\nThe person as JSON: " + sgl.gen("json", max_tokens=48, temperature=0, json_schema=PERSON)


@sgl.function
def extract_fields(s, text):
    s += f"Text: {text}\nThe person as JSON: "
    with s.var_scope("json"):
        for head, name, tokens, regex in FIELDS:
            s += head + sgl.gen(name, max_tokens=tokens, temperature=0, regex=regex)
        s += '"}'


@dataclass(frozen=True)
class Work:
    """The inputs every arm runs."""

    docs: list[str]
    tokens: int
    items: list[dict[str, str]]
    chats: list[dict[str, Any]]
    records: list[dict[str, str]]


def make_work(ns: argparse.Namespace) -> Work:
    shots = few_shot_prefix(ns.prefix_tokens)
    return Work([document(i) for i in range(ns.docs)], ns.tokens,
                [{"prefix": shots, "review": f"{REVIEWS[i % 4]} (item {i})"} for i in range(ns.items)],
                [{"topic": f"{TOPICS[i % len(TOPICS)]} ({i})", "tokens": ns.turn_tokens} for i in range(ns.chats)],
                [{"text": PEOPLE[i % 4]} for i in range(ns.records)])


def check_person(text: str) -> None:
    person = json.loads(text)
    if set(person) != {"name", "age", "city"} or not isinstance(person["age"], int):
        raise AssertionError(f"an extraction is not the schema's: {text!r}")


def history_reuse(turns: list[list[tuple[int, int, int]]]) -> float:
    """Turns 2-4's share of the history (the earlier turn's prompt and completion tokens)
    found cached; `turns`: each conversation's (prompt, completion, cached) a turn."""
    history = reused = 0
    for conversation in turns:
        for before, now in zip(conversation, conversation[1:]):
            history += before[0] + before[1]
            reused += now[2]
    return reused / history if history else 0.0


# ---- counting -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Counts:
    """Engine counters since start: requests finished, prompt tokens looked up in the prefix
    cache at admission, and of those found cached."""

    requests: int
    queried: int
    hits: int

    def __sub__(self, other: Counts) -> Counts:
        return Counts(self.requests - other.requests, self.queried - other.queried, self.hits - other.hits)


def metrics_counts(url: str, api_key: str | None) -> Counts:
    """A server's Counts from its /metrics."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    text = httpx.get(f"{url}/metrics", headers=headers, timeout=30).raise_for_status().text
    totals = {"request_success": 0.0, "prefix_cache_queries": 0.0, "prefix_cache_hits": 0.0}
    for family in text_string_to_metric_families(text):
        name = family.name.split(":", 1)[-1]
        if name in totals:
            totals[name] += sum(s.value for s in family.samples if s.name.endswith("_total"))
    return Counts(int(totals["request_success"]), int(totals["prefix_cache_queries"]), int(totals["prefix_cache_hits"]))


def measure(program: str, arm: str, variant: str, counts: Callable[[], Counts], flush: Callable[[], Any],
            run: Callable[[], Any]) -> dict[str, Any]:
    """One row: `run` on an empty prefix cache, timed and counted (a dict it returns joins the
    row); prints it as a JSON line."""
    if flush() is False:
        raise RuntimeError("the prefix cache could not be emptied (a request still runs)")
    before = counts()
    start = time.perf_counter()
    result = run()
    wall = time.perf_counter() - start
    c = counts() - before
    row = {"program": program, "arm": arm, "variant": variant, "wall_s": round(wall, 2), "requests": c.requests,
           "prompt_tokens": c.queried, "computed_tokens": c.queried - c.hits,
           "hit_rate": round(c.hits / c.queried, 3) if c.queried else None,
           **(result if isinstance(result, dict) else {})}
    print(json.dumps(row), flush=True)
    return row


# ---- the arms -----------------------------------------------------------------------------

def lang_rows(arm: str, backend: sgl.Backend, counts: Callable[[], Counts], work: Work,
              programs: list[str]) -> list[dict[str, Any]]:
    """The programs through ember.lang's run_batch on `backend`."""
    def batch(function, arguments) -> list:
        states = function.run_batch(arguments, backend=backend)
        for state in states:
            if state.error() is not None:
                raise state.error()
        return states

    rows = []
    row = (lambda program, variant, run: rows.append(measure(program, arm, variant, counts, backend.flush_cache, run)))
    summarize.run(work.docs[0][:200], 2, backend=backend)  # first-use costs (grammars too) stay out of the rows
    if "json" in programs:
        extract_schema.run(WARM_RECORD, backend=backend)
        extract_fields.run(WARM_RECORD, backend=backend)
    if "fork-join" in programs:
        row("fork-join", "outline, fork(4), join, summary",
            lambda: batch(summarize, [{"doc": d, "tokens": work.tokens} for d in work.docs]))
    if "few-shot" in programs:
        row("few-shot", "select", lambda: batch(classify, work.items))
    if "multi-turn" in programs:
        def turns() -> dict[str, Any]:
            states = batch(chat, work.chats)
            metas = [[state.get_meta_info(f"turn{i}") for i in range(len(ASKS))] for state in states]
            return {"history_reuse": round(history_reuse(
                [[(m["prompt_tokens"], m["completion_tokens"], m["cached_tokens"]) for m in ms] for ms in metas]), 3)}
        row("multi-turn", f"{len(ASKS)} turns", turns)
    if "json" in programs:
        for variant, function in (("one gen(json_schema)", extract_schema), ("var_scope of 3 regex gens",
                                                                             extract_fields)):
            row("json", variant, lambda function=function: [check_person(s["json"]) for s in
                                                            batch(function, work.records)])
    return rows


def openai_rows(url: str, api_key: str | None, work: Work, programs: list[str],
                scored_items: int | None = None) -> list[dict[str, Any]]:
    """The programs' calls one by one with the `openai` client; few-shot's labels scored for
    the first `scored_items` items (None: all)."""
    try:
        import openai
    except ImportError as e:
        raise ValueError("the openai arm needs the `openai` package: pip install openai, or leave the arm out "
                         "(--arms in-process,http)") from e
    import httpx

    client = openai.OpenAI(base_url=f"{url}/v1", api_key=api_key or "none", max_retries=0, timeout=3600)
    model = client.models.list().data[0].id
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    flush = (lambda: httpx.post(f"{url}/flush_cache", headers=headers, timeout=60).status_code == 200)
    counts = (lambda: metrics_counts(url, api_key))

    def complete(prompt: str, max_tokens: int, **extra: Any) -> str:
        return client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                         extra_body=extra or None).choices[0].text

    def summarize_one(doc: str) -> None:
        text = doc + "\nAn outline in four points:"
        text += complete(text, work.tokens, ignore_eos=True)
        heads = [f"\nPoint {i + 1} in detail:" for i in range(4)]
        text += "".join(h + complete(text + h, work.tokens, ignore_eos=True) for h in heads) + "\nIn one sentence:"
        complete(text, work.tokens, ignore_eos=True)

    def score(text: str, label: str) -> float:
        """The label's tokens' mean logprob after `text`: the prompt echoed with its logprobs."""
        lp = client.completions.create(model=model, prompt=text + label, max_tokens=1, temperature=0, echo=True,
                                       logprobs=0).choices[0].logprobs
        own = [v for v, tok, at in zip(lp.token_logprobs, lp.tokens, lp.text_offset)
               if v is not None and at + len(tok) > len(text) and at < len(text) + len(label)]
        return sum(own) / len(own)

    def converse(topic: str, tokens: int) -> list[tuple[int, int, int]]:
        messages, usage = [], []
        for ask in ASKS:
            messages.append({"role": "user", "content": ask.format(topic=topic)})
            out = client.chat.completions.create(model=model, messages=messages, max_tokens=tokens, temperature=0)
            messages.append({"role": "assistant", "content": out.choices[0].message.content})
            details = out.usage.prompt_tokens_details
            usage.append((out.usage.prompt_tokens, out.usage.completion_tokens, details.cached_tokens if details else 0))
        return usage

    def fields(text: str) -> str:
        prompt = f"Text: {text}\nThe person as JSON: "
        for head, _, tokens, regex in FIELDS:
            prompt += head
            prompt += complete(prompt, tokens, guided_regex=regex)
        return prompt[prompt.index("{"):] + '"}'

    rows = []
    row = (lambda program, variant, run: rows.append(measure(program, "openai", variant, counts, flush, run)))
    complete(work.docs[0][:200], 2)  # first-use costs (grammars too) stay out of the rows
    if "json" in programs:
        complete(f"Text: {WARM_RECORD}\nThe person as JSON: ", 48, guided_json=PERSON)
        fields(WARM_RECORD)
    if "fork-join" in programs:
        row("fork-join", "outline, 4 expansions, summary: one call at a time",
            lambda: [summarize_one(d) for d in work.docs])
    if "few-shot" in programs:
        def scored() -> None:
            for item in work.items[:scored_items]:
                text = item["prefix"] + f"Review: {item['review']}\nLabel: "
                max((score(text, label), label) for label in LABELS)
        scored_items = len(work.items) if scored_items is None else min(scored_items, len(work.items))
        if scored_items:
            row("few-shot", "each label scored (echo + logprobs)" + (
                f", the first {scored_items} items" if scored_items < len(work.items) else ""), scored)
        row("few-shot", "one guided_choice completion an item",
            lambda: [complete(i["prefix"] + f"Review: {i['review']}\nLabel: ", 8, guided_choice=LABELS)
                     for i in work.items])
    if "multi-turn" in programs:
        row("multi-turn", f"{len(ASKS)} turns: chat completions",
            lambda: {"history_reuse": round(history_reuse([converse(**c) for c in work.chats]), 3)})
    if "json" in programs:
        row("json", "guided_json completion", lambda: [check_person(complete(
            f"Text: {r['text']}\nThe person as JSON: ", 48, guided_json=PERSON)) for r in work.records])
        row("json", "3 guided_regex completions", lambda: [check_person(fields(r["text"])) for r in work.records]
           )
    return rows


# ---- the command --------------------------------------------------------------------------

def add_frontend_bench_args(parser: argparse.ArgumentParser) -> None:
    """`ember bench frontend`'s own flags (the engine's are add_engine_args')."""
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {', '.join(ARMS)}")
    parser.add_argument("--programs", default=",".join(PROGRAMS), help=f"comma-separated, of {', '.join(PROGRAMS)}")
    parser.add_argument("--url", default=None, help="the `ember serve` of the http and openai arms (default: start "
                        "one with these engine flags)")
    parser.add_argument("--api-key", default=None, help="that server's API key")
    parser.add_argument("--docs", type=int, default=4, help="fork-join: documents summarized")
    parser.add_argument("--tokens", type=int, default=64, help="fork-join: tokens each gen")
    parser.add_argument("--items", type=int, default=128, help="few-shot: reviews classified")
    parser.add_argument("--scored-items", type=int, default=None,
                        help="few-shot, openai arm: score the labels of only the first N items (each such call "
                        "computes its whole prompt: prompt logprobs from the first token find nothing cached); "
                        "default: all")
    parser.add_argument("--prefix-tokens", type=int, default=1000, help="few-shot: the shared prefix's size")
    parser.add_argument("--chats", type=int, default=32, help="multi-turn: conversations")
    parser.add_argument("--turn-tokens", type=int, default=24, help="multi-turn: tokens a turn")
    parser.add_argument("--records", type=int, default=16, help="json: records extracted")
    parser.add_argument("--out", default=None, help="write the rows to this JSON file")


def _names(value: str, allowed: tuple[str, ...], flag: str) -> list[str]:
    names = [n.strip() for n in value.split(",") if n.strip()]
    unknown = [n for n in names if n not in allowed]
    if unknown or not names:
        raise ValueError(f"{flag} takes names of {', '.join(allowed)}; got {value!r}")
    return names


def run_frontend_bench(ns: argparse.Namespace, engine_kwargs: dict[str, Any]) -> list[dict[str, Any]]:
    """Run the arms the flags ask for; print each row and a table; write them if asked."""
    arms, programs = _names(ns.arms, ARMS, "--arms"), _names(ns.programs, PROGRAMS, "--programs")
    work = make_work(ns)
    rows: list[dict[str, Any]] = []
    if "in-process" in arms:
        from ember import LLM

        llm = LLM(**engine_kwargs)
        backend = sgl.LocalBackend(llm)
        try:
            def counts() -> Counts:
                stats = llm.engine.stats()
                return Counts(backend.num_engine_requests, stats.prefix_cache_queries, stats.prefix_cache_hits)
            rows += lang_rows("in-process", backend, counts, work, programs)
        finally:
            backend.shutdown()
            llm.shutdown()
            del llm, backend
    if "http" in arms or "openai" in arms:
        with _Server(ns) as url:
            if "http" in arms:
                endpoint = sgl.RuntimeEndpoint(url, api_key=ns.api_key)
                try:
                    rows += lang_rows("http", endpoint, lambda: metrics_counts(url, ns.api_key), work, programs)
                finally:
                    endpoint.shutdown()
            if "openai" in arms:
                rows += openai_rows(url, ns.api_key, work, programs, ns.scored_items)
    print(format_table(rows))
    if ns.out:
        Path(ns.out).write_text(json.dumps({"flags": {k: v for k, v in vars(ns).items() if k != "func"
                                                      and isinstance(v, (str, int, float, bool, type(None)))},
                                            "rows": rows}, indent=1))
    return rows


class _Server:
    """--url, or an `ember serve` of the engine flags on a free port for the `with` block."""

    def __init__(self, ns: argparse.Namespace) -> None:
        self.ns = ns
        self.server = None
        self.tmp = None

    def __enter__(self) -> str:
        if self.ns.url is not None:
            return self.ns.url.rstrip("/")
        from ember.bench.tune import LocalServer, config_yaml, engine_flags

        self.tmp = tempfile.TemporaryDirectory(prefix="ember-bench-frontend-")
        config = Path(self.tmp.name) / "serve.yaml"
        config.write_text(config_yaml(engine_flags(self.ns), "ember bench frontend's server"))
        self.server = LocalServer(config, Path(self.tmp.name) / "serve.log")
        try:
            self.server.wait_ready(600)
        except BaseException:
            self.__exit__()
            raise
        return self.server.url

    def __exit__(self, *exc: Any) -> None:
        if self.server is not None:
            self.server.stop()
        if self.tmp is not None:
            self.tmp.cleanup()


def format_table(rows: list[dict[str, Any]]) -> str:
    """The rows as a markdown table."""
    lines = ["| program | arm | variant | wall | engine requests | prompt tokens | computed | hit rate | reuse |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        rate = "" if r["hit_rate"] is None else f"{100 * r['hit_rate']:.0f} %"
        reuse = f"{100 * r['history_reuse']:.1f} %" if "history_reuse" in r else ""
        lines.append(f"| {r['program']} | {r['arm']} | {r['variant']} | {r['wall_s']:.2f} s | {r['requests']:,} | "
                     f"{r['prompt_tokens']:,} | {r['computed_tokens']:,} | {rate} | {reuse} |")
    return "\n".join(lines)
