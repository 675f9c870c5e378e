"""powerinfer-cpp: fast local LLM inference that exploits activation sparsity."""

import importlib

__version__ = "0.1.0"

# Imported lazily so that pure-Python tools (the converter) work without loading the
# native library.
_LAZY = {
    "Model": "model", "Context": "model", "ContextState": "model", "Completion": "model", "ModelInfo": "model",
    "device_available": "model", "parse_size": "model",
    "Llama": "api", "LlamaState": "api", "UnsupportedArgumentError": "api", "UnsupportedFeatureError": "api",
    "ChatTemplate": "chat", "ChatTemplateError": "chat",
    "LlamaGrammar": "structured", "GrammarError": "structured", "EmbeddingError": "embeddings",
    "NativeError": "_native", "NativeIOError": "_native", "NativeValueError": "_native",
    "NativeBusyError": "_native",
}

__all__ = [*_LAZY, "__version__"]


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'powerinfer_cpp' has no attribute '{name}'")
