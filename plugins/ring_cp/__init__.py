"""ring_cp: ring-attention context parallelism for long prefill (K/V blocks travel a ring, LSE merge)."""
