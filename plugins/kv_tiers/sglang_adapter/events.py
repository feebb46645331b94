"""Layer: SGLang adapter of the kv_tiers plugin. L3 tier events in SGLang's KV-event stream.

The core `TierEventLog` records L3 stores and removals; `after_take_events` appends them to the
radix cache's own KV events as `BlockStored` / `BlockRemoved` with `instance_id` and
`storage_keys`, and the `kllm_tiers` publisher stamps every event with the instance id.
"""
from __future__ import annotations

from typing import Any, Callable

from kllm_plugins.plugins.kv_tiers.sglang_adapter import state


def after_take_events(result: Any, self: Any, *args: Any, **kwargs: Any) -> Any:
    t = state.current()
    if t is None or t.events is None:
        return None
    pending = t.events.take()
    if not pending:
        return None
    recorder = getattr(self, "kv_events", None) or getattr(getattr(self, "tree_core", None), "kv_events", None)
    if not getattr(recorder, "enabled", False):
        return None  # events off: drop ours too, as SGLang drops its own
    return list(result or []) + [to_sglang_event(e) for e in pending]


_wire_types: tuple[Any, Any] | None = None


def _wire() -> tuple[Any, Any]:
    global _wire_types
    if _wire_types is None:
        from typing import Optional as Opt

        from sglang.srt.disaggregation.kv_events import BlockRemoved, BlockStored

        class TierBlockStored(BlockStored, tag="BlockStored"):  # type: ignore[call-arg]
            instance_id: Opt[str] = None
            storage_keys: Opt[list[str]] = None

        class TierBlockRemoved(BlockRemoved, tag="BlockRemoved"):  # type: ignore[call-arg]
            instance_id: Opt[str] = None
            storage_keys: Opt[list[str]] = None

        _wire_types = (TierBlockStored, TierBlockRemoved)
    return _wire_types


def to_sglang_event(event: Any) -> Any:
    stored, removed = _wire()
    wire = event.to_wire()
    wire.pop("type")
    return (stored if event.kind == "stored" else removed)(**wire)


def register_publisher() -> Callable[[], bool]:
    """Register the `kllm_tiers` KV-event publisher (a ZMQ publisher that stamps the instance id)."""
    from sglang.srt.disaggregation.kv_events import EventPublisherFactory, ZmqEventPublisher

    class KllmTierEventPublisher(ZmqEventPublisher):
        def publish(self, events: Any) -> None:
            iid = state.tiers().instance_id
            stored, removed = _wire()
            stamped = []
            for ev in events.events:
                if getattr(ev, "instance_id", "absent") is None:
                    ev.instance_id = iid
                elif type(ev).__name__ in ("BlockStored", "BlockRemoved"):
                    cls = stored if type(ev).__name__ == "BlockStored" else removed
                    fields = {f: getattr(ev, f) for f in ev.__struct_fields__}
                    ev = cls(**fields, instance_id=iid)
                stamped.append(ev)
            events.events = stamped
            super().publish(events)

    if "kllm_tiers" not in EventPublisherFactory._registry:
        EventPublisherFactory.register_publisher("kllm_tiers", KllmTierEventPublisher)
    return lambda: "kllm_tiers" in EventPublisherFactory._registry
