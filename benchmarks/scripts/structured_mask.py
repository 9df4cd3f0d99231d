"""Structured output's per-step CPU work: xgrammar's fill of one bitmask row at a few
states of ember's BENCH_SCHEMA, and the sampler's unpack + mask of 64 rows.

    .venv/bin/python benchmarks/scripts/structured_mask.py
"""

import time

import torch

from ember.bench.throughput import BENCH_SCHEMA
from ember.loader.default_model import fetch_default_model
from ember.loader.tokenizer_files import load_tokenizer
from ember.runner.sampler import SamplingRow, apply_grammar_masks
from ember.sampling_params import SamplingParams, StructuredOutputsParams
from ember.structured.registry import make_backend

tok = load_tokenizer(fetch_default_model())
grammar = make_backend("xgrammar", tok, 49152).compile(StructuredOutputsParams(json=BENCH_SCHEMA))
bitmask = torch.empty(64, 1536, dtype=torch.int32)
for prefix in ['{"records": [{"id": 1', '{"records": [{"id": 12, "name": "bo',
               '{"records": [{"id": 12, "name": "bob", "status": "',
               '{"records": [{"id": 12, "name": "bob", "status": "active", "score": 1.']:
    matcher = grammar.matcher()
    ids = tok.encode(prefix, add_special_tokens=False)
    assert matcher.accept_tokens(ids) == len(ids)
    start = time.perf_counter()
    for i in range(64):
        matcher.fill_bitmask(bitmask, i)
    print(f"fill after {prefix[-14:]!r}: {(time.perf_counter() - start) / 64 * 1e6:.1f} us/row")
logits = torch.randn(64, 49152)
rows = [SamplingRow(SamplingParams(), None, [1], [], frozenset(), bitmask[i]) for i in range(64)]
start = time.perf_counter()
for _ in range(10):
    apply_grammar_masks(logits, rows)
print(f"unpack + mask, 64 rows: {(time.perf_counter() - start) / 10 * 1e3:.2f} ms")
