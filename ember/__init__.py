"""ember: a small, readable LLM inference and serving engine."""

import os
import sys

# torch's OpenMP workers sleep between regions instead of spinning, where nobody chose
# otherwise before torch loads: on the CPU ember's kernels run on their own thread pool
# (kernels/cpu/pool.h), and OpenMP workers spinning after each of torch's small ops (the
# sampler's) held its cores: ~25 % of a decode step on 2 cores (benchmarks/BENCHMARKS.md)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# numpy advises the kernel to back each array of 4 MiB or more with huge pages; where
# transparent_hugepage's defrag is "madvise" (Ubuntu's default) such an allocation can stall
# while the kernel compacts memory. Each image's preparation and step allocates several of
# ~19 MB: 240-310 ms an image's preparation with the advice, 73-80 ms without, on a 2-vCPU EPYC
# (benchmarks/BENCHMARKS.md). Off where nobody chose; the env var reaches ember's own processes.
if "NUMPY_MADVISE_HUGEPAGE" not in os.environ:
    os.environ["NUMPY_MADVISE_HUGEPAGE"] = "0"
    if "numpy" in sys.modules:  # loaded before ember: it read the variable already
        _numpy = sys.modules["numpy"]
        (getattr(_numpy, "_core", None) or _numpy.core).multiarray._set_madvise_hugepage(False)

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
