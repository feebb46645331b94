"""Layer: host tooling. The `kllm-plugins` command: `list`, `doctor`, `demo`, `build-model`.

`doctor` imports SGLang (to resolve every patched target); `list` does not.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import os
import sys
from typing import Sequence

import kllm_plugins
from kllm_plugins.attach import resolve_target
from kllm_plugins.errors import KllmConfigError
from kllm_plugins.manager import KllmPluginManager
from kllm_plugins.options import cli_flag, env_name


def _sglang_version() -> str | None:
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


def cmd_list(_: argparse.Namespace) -> int:
    manager = KllmPluginManager()
    for name in manager.names():
        spec = manager.specs[name]
        print(f"{name:14s} {spec.status:12s} {spec.summary}")
        for opt in spec.options:
            print(f"    {cli_flag(name, opt.name)} / {env_name(name, opt.name)} (default {opt.default}): {opt.help}")
    return 0


def doctor_report(manager: KllmPluginManager) -> tuple[list[str], int]:
    """Lines to print and the number of problems found."""
    lines = [f"kllm-plugins {kllm_plugins.__version__} (tested with SGLang {kllm_plugins.SGLANG_TESTED}, supports {kllm_plugins.SGLANG_RANGE})"]
    problems = 0
    version = _sglang_version()
    if version is None:
        lines.append("SGLang: NOT INSTALLED")
        return lines, 1
    lines.append(f"SGLang: {version}")
    selected = os.environ.get("SGLANG_PLATFORM")
    if selected and selected != "kllm_cpu":
        lines.append(
            f"WARNING: SGLANG_PLATFORM={selected}: SGLang skips general plugins of distributions that ship "
            "another platform, so kllm plugins will NOT load (this distribution ships 'kllm_cpu')."
        )
        problems += 1
    from kllm_plugins.sglang_bridge import HOST_PATCHES

    groups = [("host", HOST_PATCHES)] + [(n, manager.specs[n].patches) for n in manager.names()]
    for name, patches in groups:
        status = "" if name == "host" else f" [{manager.specs[name].status}]"
        lines.append(f"{name}{status}:")
        for patch in patches:
            try:
                resolve_target(patch.target)
                verdict = "ok"
            except Exception as exc:  # noqa: BLE001 - report every failure
                verdict = f"MISSING ({type(exc).__name__}: {exc})"
                problems += 1
            lines.append(f"  {patch.kind:8s} {patch.target}: {verdict}")
    return lines, problems


def cmd_doctor(_: argparse.Namespace) -> int:
    lines, problems = doctor_report(KllmPluginManager())
    print("\n".join(lines))
    print(f"{problems} problem(s)")
    return 1 if problems else 0


def cmd_build_model(args: argparse.Namespace) -> int:
    if args.model == "tiny":
        from kllm_plugins.models.tiny_llama import tiny_llama_path as build
    else:
        from kllm_plugins.models.smollm2 import smollm2_path as build
    print(build())
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from kllm_plugins.demo import run_demo

    return run_demo(args.model, args.plugins, args.question)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kllm-plugins", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="list available plugins and their options").set_defaults(fn=cmd_list)
    sub.add_parser("doctor", help="check SGLang and every plugin target").set_defaults(fn=cmd_doctor)
    b = sub.add_parser("build-model", help="build (once) and print the path of an offline model")
    b.add_argument("model", choices=["tiny", "smollm2"])
    b.set_defaults(fn=cmd_build_model)
    d = sub.add_parser("demo", help="serve a model through SGLang with plugins and ask it a question")
    d.add_argument("--model", choices=["tiny", "smollm2"], default="smollm2")
    d.add_argument("--plugins", default="trace")
    d.add_argument("--question", default="What is the capital of France?")
    d.set_defaults(fn=cmd_demo)
    args = parser.parse_args(argv)
    try:
        return int(args.fn(args))
    except KllmConfigError as exc:
        print(str(exc), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
