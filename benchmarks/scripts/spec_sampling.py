"""Speculative sampling's acceptance at temperature > 0 on the CPU: the draft_model method with the
default model (SmolLM2-135M-Instruct Q4_1) as target, on the 8 input-grounded chats of
benchmarks/spec_ngram_prompts.json and 3 open ones, with two drafters, the model itself and an
early exit of it (its first --layers of 30 layers, its embeddings, final norm and head: a GGUF
written here from the default model's blocks), each verified two ways on the same seeded
requests: drafts drawn from the drafter's q and kept with probability min(1, p/q) (ember's
default), and the drafter's argmax kept as a point mass (what a drafter without probabilities
gets: `ModelRunner.propose_for(sample=False)`). Prints, per drafter and way, the share of drafts
kept, the mean accepted length (tokens a verifying step adds) and output tokens per second (and
those of the target without speculation, the same requests).

    python benchmarks/scripts/spec_sampling.py [--k 4] [--layers 26] [--max-tokens 64] [--temperature 0.8]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import gguf

from ember import LLM, SamplingParams
from ember.loader.default_model import fetch_default_model

PROMPTS = Path(__file__).resolve().parents[1] / "spec_ngram_prompts.json"
OPEN = ["Write a short story about a robot who learns to paint by the sea.",
        "Explain why the sky is blue to a ten-year-old.", "List five uses for a paperclip, one a line."]


def early_exit(source: Path, layers: int, out: Path) -> Path:
    """`source`'s GGUF cut to its first `layers` blocks (the tensors copied as they are)."""
    reader = gguf.GGUFReader(source)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(out, arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        value = layers if field.name == f"{arch}.block_count" else field.contents()
        writer.add_key_value(field.name, value, kind, sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY
                             else None)
    kept = [t for t in reader.tensors if not t.name.startswith("blk.") or int(t.name.split(".")[1]) < layers]
    for t in kept:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in kept:
        writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    writer.close()
    return out


class PointMasses:
    """The engine's drafter drafting the raw argmax, verified as point masses."""

    def __init__(self, runner) -> None:
        self.runner = runner

    def propose_for(self, requests):
        return self.runner.propose_for(requests, sample=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--layers", type=int, default=26, help="the early exit's layers (of 30)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-p", type=float, default=0.95)
    args = ap.parse_args()
    target = fetch_default_model()
    chats = [item["messages"] for item in json.loads(PROMPTS.read_text())] + \
        [[{"role": "user", "content": text}] for text in OPEN]
    with tempfile.TemporaryDirectory() as tmp:
        drafters = {"itself": target, f"early exit, {args.layers} layers": early_exit(
            target, args.layers, Path(tmp) / "early.gguf")}
        plain = LLM(str(target), enable_prefix_caching=False)
        params = [SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens,
                                 ignore_eos=True, seed=i) for i in range(len(chats))]
        plain.chat(chats[:1], params[0])  # warm-up
        start = time.perf_counter()
        made = sum(len(plain.chat([chat], sp)[0].outputs[0].token_ids) for chat, sp in zip(chats, params))
        rows = [("none (no speculation)", "", None, None, made / (time.perf_counter() - start))]
        plain.shutdown()
        for name, path in drafters.items():
            llm = LLM(str(target), enable_prefix_caching=False,
                      speculative_config={"model": str(path), "num_speculative_tokens": args.k})
            llm.chat(chats[:1], params[0])  # warm-up
            own = llm.engine.proposer
            for way, proposer in (("q", own), ("point masses", PointMasses(llm.engine.runner))):
                llm.engine.proposer = proposer
                counts = llm.engine.scheduler.spec
                before = counts.num_drafts, counts.num_draft_tokens, counts.num_accepted_tokens
                start = time.perf_counter()
                made = 0
                for chat, sp in zip(chats, params):  # one request at a time
                    made += len(llm.chat([chat], sp)[0].outputs[0].token_ids)
                seconds = time.perf_counter() - start
                steps, drafted, kept = (now - then for now, then in zip(
                    (counts.num_drafts, counts.num_draft_tokens, counts.num_accepted_tokens), before))
                rows.append((name, way, kept / drafted, 1 + kept / steps, made / seconds))
            llm.engine.proposer = own
            llm.shutdown()
    print(f"K={args.k}, temperature {args.temperature}, top_p {args.top_p}, {len(chats)} prompts x "
          f"{args.max_tokens} tokens, one request at a time")
    print("| drafter | drafts verified as | drafts kept | mean accepted length | tok/s |")
    print("|---|---|---|---|---|")
    for name, way, rate, length, speed in rows:
        kept = "" if rate is None else f"{rate:.1%}"
        accepted = "" if length is None else f"{length:.2f}"
        print(f"| {name} | {way} | {kept} | {accepted} | {speed:.1f} |")


if __name__ == "__main__":
    main()
