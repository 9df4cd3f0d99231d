"""ember: a small, readable LLM inference and serving engine."""

from ember.config import EngineConfig
from ember.outputs import CompletionOutput, RequestOutput
from ember.sampling_params import SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM pulls in the tokenizer stack; import it on first use so `import ember` stays light.
    if name == "LLM":
        from ember.engine.llm import LLM

        return LLM
    raise AttributeError(f"module 'ember' has no attribute {name!r}")


__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "EngineConfig", "RequestOutput", "CompletionOutput"]
