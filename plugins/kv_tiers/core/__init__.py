"""Layer: plugin core (no SGLang import). Store, policies and event format of the kv_tiers plugin."""
