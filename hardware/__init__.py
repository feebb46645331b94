"""Device adapters of kllm-plugins (installed as kllm_plugins.hardware).

Plugins do device work only through `get_adapter()`; see interface.py.
"""
from __future__ import annotations

from kllm_plugins.hardware.registry import available_adapters, get_adapter

__all__ = ["get_adapter", "available_adapters"]
