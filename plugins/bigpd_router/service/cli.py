"""Layer: service (no SGLang import). `kllm-router`: command line of the standalone router.

Router options are the plugin's options (same names as `--kllm-bigpd-router-*`, the
`KLLM_BIGPD_ROUTER_*` variables and the `bigpd_router:` YAML section); instances come from
--worker/--prefill/--decode, an instances file, the admin API, or the scaling actuator.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import shlex
import signal
from typing import Any

import yaml

from kllm_plugins.options import cli_dest, load_yaml_config, resolve_options
from kllm_plugins.plugins.bigpd_router.config import RouterConfig
from kllm_plugins.plugins.bigpd_router.core.registry import Role
from kllm_plugins.plugins.bigpd_router.core.scaling import Actuator
from kllm_plugins.plugins.bigpd_router.hookimpls import kllm_declare
from kllm_plugins.plugins.bigpd_router.service import logs
from kllm_plugins.plugins.bigpd_router.service.router import Router

log = logging.getLogger("kllm.bigpd_router.cli")
PLUGIN = "bigpd_router"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kllm-router", description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30080)
    ap.add_argument("--worker", action="append", default=[], help="plain SGLang instance URL (repeatable)")
    ap.add_argument("--prefill", action="append", default=[], help="PD prefill instance URL (repeatable)")
    ap.add_argument("--decode", action="append", default=[], help="PD decode instance URL (repeatable)")
    ap.add_argument("--instances-file", help="YAML list of {url, role?, bootstrap_port?}")
    ap.add_argument("--config", help="kllm YAML config (its bigpd_router: section)")
    ap.add_argument("--actuator", choices=("none", "local", "kubernetes"), default="none")
    ap.add_argument("--scale-roles", default="", help="pools the controller scales, e.g. prefill,decode or plain")
    ap.add_argument("--local-model-path", help="local actuator: model path for new instances")
    ap.add_argument("--local-args", default="", help="local actuator: extra sglang.launch_server arguments")
    ap.add_argument("--local-pd-backend", default="mooncake",
                    help="local actuator: --disaggregation-transfer-backend (SGLang refuses 'fake' on prefill)")
    ap.add_argument("--local-standby", default="",
                    help="local actuator: warm standby instances per pool, e.g. plain=1 or prefill=1,decode=1")
    ap.add_argument("--local-standby-memory-gb", type=float, default=0.0,
                    help="local actuator: memory bound of all standbys together (0: none)")
    ap.add_argument("--k8s-namespace", default="default")
    ap.add_argument("--k8s-api", help="Kubernetes API URL (default: in-cluster config, then kubeconfig)")
    ap.add_argument("--k8s-deployment", action="append", default=[],
                    help="ROLE=DEPLOYMENT:LABEL_SELECTOR:PORT, e.g. prefill=kllm-prefill:app=kllm-prefill:30000")
    ap.add_argument("--log-format", choices=("json", "text"), default="json")
    ap.add_argument("--log-level", default="INFO")
    ap.add_argument("--shutdown-timeout-s", type=float, default=30.0)
    spec = kllm_declare()
    group = ap.add_argument_group("router options (also KLLM_BIGPD_ROUTER_* and YAML)")
    for opt in spec.options:
        group.add_argument("--" + opt.name.replace("_", "-"), dest=cli_dest(PLUGIN, opt.name), default=None,
                           help=f"{opt.help} (default {opt.default})")
    return ap


def config_from(args: argparse.Namespace, environ: dict[str, str] | None = None) -> RouterConfig:
    yaml_values = load_yaml_config(args.config).get(PLUGIN, {}) if args.config else {}
    values = resolve_options(kllm_declare(), vars(args), environ if environ is not None else dict(os.environ),
                             yaml_values)
    return RouterConfig(**values)


def make_actuator(args: argparse.Namespace) -> Actuator | None:
    if args.actuator == "local":
        from kllm_plugins.plugins.bigpd_router.actuators.local_process import LocalProcessActuator

        if not args.local_model_path:
            raise SystemExit("kllm-router: --actuator local needs --local-model-path")
        pd = ["--disaggregation-transfer-backend", args.local_pd_backend]
        local = LocalProcessActuator(args.local_model_path, shlex.split(args.local_args),
                                     {Role.PREFILL: ["--disaggregation-mode", "prefill", *pd],
                                      Role.DECODE: ["--disaggregation-mode", "decode", *pd]},
                                     role_switch=config_from(args).scale_role_switch)
        if not args.local_standby:
            return local
        from kllm_plugins.plugins.bigpd_router.actuators.standby_actuator import StandbyActuator
        from kllm_plugins.plugins.bigpd_router.core.standby_pool import StandbyPolicy, StandbyPool

        try:
            sizes = {Role(k): int(v) for k, v in (item.split("=") for item in args.local_standby.split(","))}
        except ValueError:
            raise SystemExit(f"kllm-router: --local-standby wants ROLE=N[,ROLE=N], got {args.local_standby!r}")
        policy = StandbyPolicy(size=sizes, max_memory_bytes=int(args.local_standby_memory_gb * (1 << 30)))
        return StandbyActuator(local, StandbyPool(policy)).start()
    if args.actuator == "kubernetes":
        from kllm_plugins.plugins.bigpd_router.actuators.kubernetes_scale import (
            KubernetesActuator,
            PoolWorkload,
            make_api_client,
        )

        pools = {}
        for item in args.k8s_deployment:
            role, _, rest = item.partition("=")
            name, selector, port = rest.split(":")
            pools[Role(role)] = PoolWorkload(name, selector, int(port))
        return KubernetesActuator(args.k8s_namespace, pools, make_api_client(args.k8s_api))
    return None


def instances_from(args: argparse.Namespace) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{"url": u, "role": "plain"} for u in args.worker]
    out += [{"url": u, "role": "prefill"} for u in args.prefill]
    out += [{"url": u, "role": "decode"} for u in args.decode]
    if args.instances_file:
        with open(args.instances_file, encoding="utf-8") as fh:
            items = yaml.safe_load(fh) or []
        if not isinstance(items, list):
            raise SystemExit(f"kllm-router: {args.instances_file} must hold a list of {{url, role}}")
        out += [i if isinstance(i, dict) else {"url": str(i)} for i in items]
    return out


def build_router(args: argparse.Namespace) -> Router:
    cfg = config_from(args)
    roles = tuple(Role(r) for r in args.scale_roles.split(",") if r)
    return Router(cfg, make_actuator(args), roles)


async def register_all(router: Router, items: list[dict[str, Any]]) -> None:
    for item in items:
        role = Role(item["role"]) if item.get("role") else None
        try:
            await router.add_instance(item["url"], role, item.get("bootstrap_port"))
        except (ConnectionError, ValueError) as exc:
            log.error("cannot add instance %s: %s", item["url"], exc)


async def serve(router: Router, args: argparse.Namespace, items: list[dict[str, Any]]) -> None:
    """Run until SIGTERM/SIGINT, then shut down gracefully (streams in flight may finish)."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await router.start()
    await register_all(router, items)
    port = await router.serve(args.host, args.port)
    log.info("kllm-router on http://%s:%d policy=%s instances=%d actuator=%s", args.host, port,
             router.cfg.policy, len(items), args.actuator)
    await stop.wait()
    log.info("shutting down: waiting up to %.0f s for requests in flight", args.shutdown_timeout_s)
    await router.shutdown(args.shutdown_timeout_s)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logs.setup(args.log_level, args.log_format == "json")
    router = build_router(args)
    items = instances_from(args)
    try:  # uvloop roughly halves the per-request cost of the event loop where it is installed
        import uvloop

        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    gc.freeze()  # start-up objects never change: keep them out of the collector's work (shorter pauses)
    try:
        runner(serve(router, args, items))
    finally:
        stop_all = getattr(router.actuator, "stop_all", None)
        if callable(stop_all):
            stop_all()


if __name__ == "__main__":
    main()
