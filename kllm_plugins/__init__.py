"""kllm-plugins: production LLM-inference optimizations for SGLang, one plugin per capability.

Layer: package root. Importing it never imports SGLang.
"""
from __future__ import annotations

__version__ = "0.1.0"

SGLANG_TESTED = "0.5.23"
SGLANG_RANGE = ">=0.5.23,<0.6"
