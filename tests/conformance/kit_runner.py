"""Run one case of one of SGLang's server kits (`sglang.test.kits.*`, unittest mixins) as a
pytest test against a running set-up, without editing the kit.

A kit mixin expects a `CustomTestCase` subclass with `base_url` and `process` (and some kits
`model`, `flush_cache`, tuning attributes): `kit_case` builds that class around the kit, with
the kit's own tuning attributes set where the CPU needs smaller numbers, and runs the one test
method. Assertion errors are the kit's own.
"""
from __future__ import annotations

import unittest
from typing import Any

from kllm_plugins.testing.sglang_server import flush_cache


def kit_case(kit: type, method: str, base_url: str, process: Any, flush_url: str | None = None,
             **attrs: Any) -> None:
    """Run `kit.<method>` against `base_url` (`process`: the server's Popen, which kits poll)."""
    flush_target = flush_url or base_url
    namespace = {
        "base_url": base_url,
        "process": process,
        "model": "default",
        "flush_cache": classmethod(lambda cls: flush_cache(flush_target)),
        **attrs,
    }
    case_cls = type(f"{kit.__name__}OnKllm", (kit, unittest.TestCase), namespace)
    case = case_cls(method)
    getattr(case, method)()
