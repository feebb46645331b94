"""Capability plugins of kllm-plugins, one sub-package each (installed as kllm_plugins.plugins)."""
