"""kv_tiers: L2/L3 KV tiers that pay off (checked file store, fetch-or-recompute, selective persistence, tier events)."""
