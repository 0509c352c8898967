"""heron: an LLM inference engine and OpenAI-compatible server."""

from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "__version__"]

if TYPE_CHECKING:
    from heron.engine.llm import LLM
    from heron.outputs import CompletionOutput, RequestOutput
    from heron.sampling_params import SamplingParams


def __getattr__(name: str):  # lazy: `import heron` stays cheap (no torch import)
    if name == "LLM":
        from heron.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from heron.sampling_params import SamplingParams

        return SamplingParams
    if name in ("RequestOutput", "CompletionOutput"):
        from heron import outputs

        return getattr(outputs, name)
    raise AttributeError(f"module 'heron' has no attribute {name!r}")
