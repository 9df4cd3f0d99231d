"""Benchmarks (vLLM's `vllm bench` shapes): `throughput` is offline batch throughput on random
prompts; `hf_baseline` runs the same workload through HF transformers for comparison."""
