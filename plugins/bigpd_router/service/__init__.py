"""Layer: service (no SGLang import). The kllm-router HTTP process: proxying, admin API, loops."""
