"""Layer: plugin core (no SGLang import). Walk-state bookkeeping for incremental prefix inserts."""
