"""Layer: core (no SGLang import). Registry, SLO Load, prefix affinity, pairing and scaling."""
