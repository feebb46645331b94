"""A live PD role switch decided by the controller, with traffic running (real SGLang, CPU).

Three tiny-model servers over Mooncake TCP, all started with --enable-pd-role-switch: one prefill,
two decode. Clients send long prompts (greedy, a few output tokens) without pause, so the prefill
pool's SLO Load goes over its target while the decode pool idles; the controller, with role
switching on and no way to start new servers (its actuator refuses `add`), lends the idlest decode
server: it drains, is flipped with POST /pd_role_switch and rejoins as a prefill server. Every
answer is checked against the reference model (greedy, float32). Prints a JSON summary: requests,
failures, wrong outputs, the switch, and the prefill batches the switched server ran afterwards.
Not a timed benchmark; run it alone (three servers on two cores).

    python benchmarks/bigpd_router/run_role_switch_live.py --seconds 60
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
import time
from typing import Any

import aiohttp

from kllm_plugins.bench.client import astream
from kllm_plugins.plugins.bigpd_router.actuators.local_process import LocalProcessActuator
from kllm_plugins.plugins.bigpd_router.config import RouterConfig
from kllm_plugins.plugins.bigpd_router.core.registry import Role
from kllm_plugins.plugins.bigpd_router.service.router import Router
from kllm_plugins.testing.sglang_server import SGLangServer, free_port, start_all

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from loadgen import merge_results  # noqa: E402


class SwitchOnlyActuator(LocalProcessActuator):
    """Flips roles of the servers this script started; never starts new ones."""

    def add(self, role: Role) -> str | None:  # type: ignore[override]
        return None


def reference(model_path: str, prompts: list[list[int]], n: int) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            g = model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False)
            out.append(g[0, len(p):].tolist())
    return out


async def drive(rurl: str, router: Router, prompts: list[list[int]], want: list[list[int]], seconds: float,
                clients: int, n: int, after_switch_s: float) -> dict[str, Any]:
    log: list[dict[str, Any]] = []
    membership: list[tuple[float, dict[str, str]]] = []
    t0 = time.monotonic()
    stop_at = [t0 + seconds]
    switched_at: list[float] = []

    async def watch() -> None:
        last: dict[str, str] = {}
        while time.monotonic() < stop_at[0]:
            now = {i.url: f"{i.role.value}/{i.health.value}" for i in router.registry}
            if now != last:
                membership.append((round(time.monotonic() - t0, 2), now))
                last = now
            if router.controller and router.controller.switching and not switched_at:
                switched_at.append(time.monotonic())
                stop_at[0] = min(stop_at[0], time.monotonic() + after_switch_s)
            await asyncio.sleep(0.2)

    async def client(c: int, s: aiohttp.ClientSession) -> None:
        k = c
        while time.monotonic() < stop_at[0]:
            k = (k + clients) % len(prompts)
            t = time.monotonic()
            r = await astream(s, rurl + "/generate", {"input_ids": prompts[k], "sampling_params": {
                "max_new_tokens": n, "temperature": 0}}, timeout=aiohttp.ClientTimeout(total=120))
            row = {"t": round(t - t0, 2), "status": r.status, "correct": r.ok and r.last.get("output_ids") == want[k],
                   "decode": next((v for h, v in r.headers.items() if h.lower() == "x-kllm-instance"), ""), "s": round(time.monotonic() - t, 2)}
            if r.error:
                row["error"] = r.error
            log.append(row)

    async with aiohttp.ClientSession() as s:
        await asyncio.gather(watch(), *(client(c, s) for c in range(clients)))
    return {"log": log, "membership": membership,
            "switch_started_s": round(switched_at[0] - t0, 2) if switched_at else None}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=90.0, help="longest run if no switch happens")
    ap.add_argument("--after-switch-s", type=float, default=30.0, help="traffic kept up after the switch starts")
    ap.add_argument("--clients", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=400)
    ap.add_argument("--out", default="", help="write the JSON summary here too")
    ap.add_argument("--record", action="store_true",
                    help="put the summary into benchmarks/results/bigpd_router/summary.json")
    args = ap.parse_args()
    from kllm_plugins.models.tiny_llama import tiny_llama_path

    model = str(tiny_llama_path())
    env = {"MOONCAKE_PROTOCOL": "tcp", "MC_FORCE_TCP": "1",
           "KLLM_EXTRA_PLUGINS": "kllm_plugins.plugins.bigpd_router.hookimpls"}
    common = ["--disaggregation-transfer-backend", "mooncake", "--dtype", "float32", "--enable-pd-role-switch",
              "--disable-overlap-schedule", "--disaggregation-decode-retraction-backup", "cpu_tensor"]
    servers = [SGLangServer(model, plugins=["bigpd_router"], env=env, max_total_tokens=4096, extra_args=[
        *common, "--disaggregation-mode", mode, "--disaggregation-bootstrap-port", str(free_port())])
        for mode in ("prefill", "decode", "decode")]
    prompts = [[(i * 7919 + k * 31) % 4000 + 10 for k in range(args.prompt_tokens)] for i in range(8)]
    n = 4
    want = reference(model, prompts, n)
    start_all(servers)
    cfg = RouterConfig(ttft_target_s=0.2, tpot_target_s=5.0, health_interval_s=1.0, loads_interval_s=1.0,
                       scale_interval_s=1.0, scale_up_sustain_s=3.0, scale_down_sustain_s=1e6, scale_cooldown_s=5.0,
                       scale_role_switch=True, min_instances=1, max_instances=2, load_window_s=10.0,
                       first_token_timeout_s=60)

    async def go() -> dict[str, Any]:
        router = Router(cfg, SwitchOnlyActuator(model, role_switch=True), (Role.PREFILL, Role.DECODE))
        async with router.serving(shutdown_timeout_s=5) as rurl:
            for srv in servers:
                await router.add_instance(srv.base_url)
            res = await drive(rurl, router, prompts, want, args.seconds, args.clients, n, args.after_switch_s)
            res["decisions"] = [{"at": round(d.at, 1), "pool": d.role.value, "action": d.action, "count": d.count,
                                 "reason": d.reason} for d in (router.controller.decisions if router.controller else [])]
            res["final_roles"] = {i.url: i.role.value for i in router.registry}
        return res

    try:
        res = asyncio.run(go())
        after = {}
        for srv in servers:
            text = open(srv.log_path, encoding="utf-8", errors="replace").read()
            m = re.search(r"PD role switch succeeded: (\w+) -> (\w+)", text)
            tail = text[m.end():] if m else ""
            after[srv.base_url] = {"switched": m.group(0) if m else None,
                                   "prefill_batches_after_switch": len(re.findall(r"Prefill batch", tail))}
    finally:
        for srv in servers:
            srv.stop()
    log = res.pop("log")
    summary = {"requests": len(log), "failed": sum(1 for r in log if r["status"] != 200),
               "wrong_output": sum(1 for r in log if r["status"] == 200 and not r["correct"]),
               "requests_after_switch_started": sum(1 for r in log if res["switch_started_s"] is not None
                                                    and r["t"] >= res["switch_started_s"]),
               "servers": {s.base_url: m for s, m in zip(servers, ("prefill", "decode", "decode"))},
               **res, "after_switch": after, "failures": [r for r in log if r["status"] != 200][:10]}
    text = json.dumps(summary, indent=1)
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as fh:
            fh.write(text)
    if args.record:
        command = " ".join(["python", *sys.argv])
        merge_results("role_switch_live", {"command": command, **{k: v for k, v in summary.items() if k != "membership"}},
                      command, command_key="role_switch_live")
        switched = [v["switched"] for v in summary["after_switch"].values() if v["switched"]]
        batches = sum(v["prefill_batches_after_switch"] for v in summary["after_switch"].values())
        # the summary line (benchmarks/RESULTS.md is generated from the results files)
        print(f"| bigpd_router | live PD role switch (not timed): 3 real tiny-model SGLang servers on CPU over "
              f"Mooncake TCP (1 prefill, 2 decode, all --enable-pd-role-switch), {args.clients} clients "
              f"sending {args.prompt_tokens}-token prompts; the controller (no new servers allowed) lends a "
              f"decode server to the prefill pool | {summary['requests']} requests, {summary['failed']} "
              f"failed, {summary['wrong_output']} with output different from the reference; "
              f"{summary['requests_after_switch_started']} sent after the switch started; switches: "
              f"{switched or 'none'}; prefill batches run by the switched server afterwards: {batches} | "
              f"`{command}` |")
    sys.exit(0 if summary["failed"] == 0 and summary["wrong_output"] == 0 else 1)


if __name__ == "__main__":
    main()
