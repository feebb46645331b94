"""fair_sched: chunk-level fair prefill scheduling and decode KV protection for SGLang."""
