"""Test-only plugins (tests/support on PYTHONPATH).

Load with KLLM_EXTRA_PLUGINS=kllm_test_plugins:broken_target,kllm_test_plugins:picky.
`broken_target` patches an SGLang attribute that does not exist, to prove that a failed
attachment is caught; `picky` refuses a combination in kllm_validate.
"""
from __future__ import annotations

from dataclasses import dataclass

from kllm_plugins.hookspecs import hookimpl
from kllm_plugins.spec import OptionSpec, PatchSpec, PluginSpec


def passthrough(original, *args, **kwargs):  # type: ignore[no-untyped-def]
    return original(*args, **kwargs)


class BrokenTarget:
    @hookimpl
    def kllm_declare(self) -> PluginSpec:
        return PluginSpec(
            name="broken_target",
            summary="patches a target that does not exist (test only)",
            status="experimental",
            patches=(
                PatchSpec(
                    target="sglang.srt.managers.scheduler.Scheduler.no_such_method_kllm",
                    impl="kllm_test_plugins:passthrough",
                    kind="around",
                    why="test of attachment verification",
                ),
            ),
        )


@dataclass(frozen=True)
class PickyConfig:
    level: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.level <= 3:
            raise ValueError(f"level must be in [0, 3], got {self.level}")


class Picky:
    @hookimpl
    def kllm_declare(self) -> PluginSpec:
        return PluginSpec(
            name="picky",
            summary="an option with a range check and a validate hook (test only)",
            status="experimental",
            options=(OptionSpec("level", int, 1, "a level from 0 to 3"),),
            config_factory=PickyConfig,
        )

    @hookimpl
    def kllm_validate(self, config: PickyConfig, enabled: list[str]) -> None:
        if config.level == 3 and "trace" in enabled:
            raise ValueError("level 3 cannot be combined with trace")


broken_target = BrokenTarget()
picky = Picky()

