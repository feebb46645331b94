"""trace: a diagnostic plugin that counts scheduler passes, prefill chunks and decode steps."""
