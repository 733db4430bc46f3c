"""hf_paged: a paged KV cache and a continuous-batching engine for Hugging Face transformers.

`import hf_paged` registers the "paged" attention implementation and takes over
`generate(..., cache_implementation="paged")`; `hf_paged.disable()` restores transformers' own behaviour.
"""
from .config import EngineConfig
from .engine import Engine
from .integrations.paged_cache import PagedCache
from .integrations.patch import disable, enable, is_enabled
from .llm import LLM
from .model.switches import HfPagedDisabled
from .request import CompletionOutput, RequestOutput
from .sampling import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "Engine", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput",
           "enable", "disable", "is_enabled", "HfPagedDisabled", "PagedCache"]

enable()
