"""Offline models for tests and the demo: a tiny random Llama and SmolLM2-135M-Instruct."""
