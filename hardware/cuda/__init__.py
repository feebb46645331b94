"""NVIDIA CUDA adapter."""
