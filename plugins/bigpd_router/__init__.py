"""bigpd_router: a router in front of SGLang instances with global prefill/decode pools,
per-request pairing, SLO Load per side and an independent scaling controller per pool."""
