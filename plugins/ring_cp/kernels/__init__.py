"""Layer: ring_cp device kernels (no SGLang import). Reached only through core.block_attn's adapter-based selection."""
