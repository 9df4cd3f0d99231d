"""ember: a small, readable LLM inference and serving engine."""

import os

# torch's OpenMP workers sleep between regions instead of spinning, where nobody chose
# otherwise before torch loads: on the CPU ember's kernels run on their own thread pool
# (kernels/cpu/pool.h), and OpenMP workers spinning after each of torch's small ops (the
# sampler's) held its cores: ~25 % of a decode step on 2 cores (benchmarks/BENCHMARKS.md)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from ember.config import EngineConfig  # noqa: E402
from ember.outputs import CompletionOutput, RequestOutput  # noqa: E402
from ember.sampling_params import BeamSearchParams, SamplingParams, StructuredOutputsParams  # noqa: E402

__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM pulls in the tokenizer stack; import it on first use so `import ember` stays light.
    if name == "LLM":
        from ember.engine.llm import LLM

        return LLM
    raise AttributeError(f"module 'ember' has no attribute {name!r}")


__all__ = ["LLM", "SamplingParams", "BeamSearchParams", "StructuredOutputsParams", "EngineConfig", "RequestOutput", "CompletionOutput"]
