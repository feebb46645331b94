"""Layer: kv_tiers device kernels (Triton; no SGLang import), reached from core/staged_copy.py."""
