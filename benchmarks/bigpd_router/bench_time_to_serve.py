"""Time-to-serve of a new SGLang instance on this CPU, broken down, for each way to add one.

Real SGLang 0.5.23 servers on the kllm CPU platform behind kllm-router (not a simulation). Every
measurement starts at the scaling controller's decision (its pool minimum is raised from 0 to 1
with the router running) and ends when the first request sent through the router is answered
by the new instance. Paths, interleaved per repeat:
- cold: the page cache dropped first (`sync; echo 1 > /proc/sys/vm/drop_caches`, needs root;
  the model file's cached fraction is read with fincore before the start and recorded);
- warm: the same start right after another one (files in the page cache);
- standby: a standby pool of one ready instance (`StandbyActuator`): the decision promotes it.
Once per model (not on the decision path): `release`: POST /release_memory_occupation and
/resume_memory_occupation on a ready idle instance, with its memory (PSS of its processes)
before and after; `remote_instance`: a second server started with `--load-format
remote_instance` from the first, and what SGLang answers.

Start-up phases come from the instance's own log, each line stamped with the time it was read:
spawn -> first log line (launch_server imports, argument parsing) -> scheduler process up
("Init parallel begin": tokenizer manager, spawn and imports of the scheduler) -> weight load
begins (model classes) -> weights loaded -> memory pools allocated -> HTTP server up -> SGLang's
own warm-up done ("fired up") -> first routed request answered (router health check,
registration, the request).

    python benchmarks/bigpd_router/bench_time_to_serve.py --models tiny smollm2 --repeats 3
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from typing import Any

import aiohttp

from kllm_plugins.bench import stats
from kllm_plugins.bench.client import astream
from kllm_plugins.plugins.bigpd_router.actuators.local_process import LocalProcessActuator
from kllm_plugins.plugins.bigpd_router.actuators.standby_actuator import (
    StandbyActuator,
    http_json,
    process_group_memory_bytes,
)
from kllm_plugins.plugins.bigpd_router.config import RouterConfig
from kllm_plugins.plugins.bigpd_router.core.registry import Health, Role
from kllm_plugins.plugins.bigpd_router.core.standby_pool import StandbyPolicy, StandbyPool
from kllm_plugins.plugins.bigpd_router.service.router import Router

RESULT_NAME = "time_to_serve"
"""benchmarks/results/bigpd_router/time_to_serve.json"""
ARGS = ["--max-total-tokens", "4096", "--sleep-on-idle"]
# Where the servers run: the GPU driver (benchmarks/gpu/time_to_serve_gpu.py) replaces these four,
# and MODELS, RESULTS_ROOT and PLATFORM_NOTE, before it calls main()
ENV = {"SGLANG_PLATFORM": "kllm_cpu"}
MILESTONES = [
    ("first_log", re.compile(r"^\[\d{4}-\d\d-\d\d ")),
    ("scheduler_up", re.compile(r"Init parallel begin")),
    ("load_begin", re.compile(r"Load weight begin")),
    ("load_end", re.compile(r"Load weight end")),
    ("pools_end", re.compile(r"Memory pool end")),
    ("http_up", re.compile(r"Uvicorn running on")),
    ("ready", re.compile(r"The server is fired up and ready to roll")),
]
PHASES = [("decision_to_spawn", "decision", "spawn"), ("imports", "spawn", "first_log"),
          ("scheduler_start", "first_log", "scheduler_up"), ("model_init", "scheduler_up", "load_begin"),
          ("model_load", "load_begin", "load_end"), ("memory_pools", "load_end", "pools_end"),
          ("http_server", "pools_end", "http_up"), ("warm_up", "http_up", "ready"),
          ("router_registers", "ready", "routable"), ("first_request", "request_sent", "served")]
STANDBY_PHASES = [("promote_and_register", "decision", "routable"), ("first_request", "request_sent", "served")]
SHARED = "shared 2-core, several helpers running tests and servers: timings are noisy, load averages per start"
MACHINE = None
"""None: this machine, described with SHARED"""
LABEL = "REAL SGLang CPU servers"
BODY = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
RESULTS_ROOT = None
"""None: the repository's benchmarks/results/"""
PLATFORM_NOTE = ("Real SGLang 0.5.23 servers on the kllm CPU platform behind kllm-router; GPU figures: "
                 "benchmarks/results/bigpd_router/gpu_time_to_serve.json")


def tiny_path() -> str:
    from kllm_plugins.models.tiny_llama import tiny_llama_path

    return str(tiny_llama_path())


def smollm2_path() -> str:
    from kllm_plugins.models.smollm2 import smollm2_path as path

    return str(path())


MODELS = {"tiny": tiny_path, "smollm2": smollm2_path}
"""name -> a function returning the model's folder (built or found on first call)"""


def model_path(name: str) -> str:
    return MODELS[name]()


def weights_file(path: str) -> str | None:
    files = [os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors")]
    return max(files, key=os.path.getsize) if files else None


def cached_fraction(path: str | None) -> float | None:
    """Share of a file's pages in the page cache (util-linux fincore), None when unknown."""
    if path is None:
        return None
    try:
        out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES,SIZE", path],
                             capture_output=True, text=True, timeout=10).stdout.split()
        return round(int(out[0]) / max(1, int(out[1])), 3)
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None


def drop_page_cache() -> str:
    subprocess.run(["sync"], check=False)
    try:
        with open("/proc/sys/vm/drop_caches", "w", encoding="ascii") as fh:
            fh.write("1\n")
        return "dropped"
    except OSError as exc:
        return f"not dropped: {exc.strerror}"


def milestones(log_path: str) -> dict[str, float]:
    """Wall time of the first line matching each milestone in a stamped log."""
    out: dict[str, float] = {}
    with open(log_path, encoding="utf-8", errors="replace") as fh:
        for line in fh:
            stamp, _, text = line.partition(" ")
            for name, pat in MILESTONES:
                if name not in out and pat.search(text):
                    try:
                        out[name] = float(stamp)
                    except ValueError:
                        pass
    return out


async def first_served(rurl: str, timeout_s: float, tries: list[tuple[float, int, float]]) -> tuple[float, float, str]:
    """Send the request through the router until it is answered; (wall time sent, answered, instance).
    `tries` gets (sent, status, seconds) of the last attempts."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            sent = time.time()
            r = await astream(s, rurl + "/generate", BODY, timeout=aiohttp.ClientTimeout(total=60), meta=False)
            if not r.broken:
                tries.append((sent, r.status, time.time() - sent))
                del tries[:-4]
                if r.status == 200:
                    return sent, time.time(), r.headers.get("X-Kllm-Instance", "")
            await asyncio.sleep(0.05)
    raise TimeoutError(f"no request served through the router within {timeout_s}s")


async def one_start(model: str, path: str, how: str, log_dir: str, timeout_s: float) -> dict[str, Any]:
    base = LocalProcessActuator(path, common_args=ARGS, env={**ENV, "PYTHONUNBUFFERED": "1"},
                                log_dir=log_dir, stamp_log=True)
    # no refill: a replacement standby starting right after the promotion would compete with the
    # promoted instance's first requests for the two cores (measured: SmolLM2's first 8-token request
    # 6.2 s with the refill starting, 0.6-0.7 s without); the refill's cost is a cold start, measured above
    pool = StandbyPool(StandbyPolicy(size={Role.PLAIN: 1 if how == "standby" else 0}, refill=False))
    act = StandbyActuator(base, pool)
    row: dict[str, Any] = {"model": model, "path": how}
    cfg = RouterConfig(health_interval_s=0.5, scale_interval_s=0.25, min_instances=0, max_instances=1,
                       loads_interval_s=0, scale_cooldown_s=0)
    router = Router(cfg, act, (Role.PLAIN,))
    routable: dict[str, float] = {}
    router.registry.subscribe(lambda ev, inst: routable.setdefault(inst.url, time.time())
                              if ev == "health" and inst.health is Health.HEALTHY else None)
    try:
        if how == "standby":
            act.start()
            if not await asyncio.to_thread(act.wait_filled, timeout_s):
                raise TimeoutError("standby pool not filled")
            row["standby_memory_bytes"] = pool.memory_bytes()
        if how == "cold":
            row["page_cache"] = drop_page_cache()
        row["weights_cached_fraction_before"] = cached_fraction(weights_file(path))
        row["load_avg_1min_before"] = round(os.getloadavg()[0], 2)
        port = await router.serve("127.0.0.1", 0)
        rurl = f"http://127.0.0.1:{port}"
        assert router.controller is not None
        dec = router.controller.deciders[Role.PLAIN]
        dec.policy = dataclasses.replace(dec.policy, min_instances=1)  # the scale-up decision
        tries: list[tuple[float, int, float]] = []
        sent_wall, served_wall, inst_url = await first_served(rurl, timeout_s, tries)
        d = router.controller.decisions[0]
        decision_wall = d.at + (time.time() - time.monotonic())
        inst = router.registry.get(inst_url)
        row.update(instance=inst_url, healthy=inst is not None and inst.health is Health.HEALTHY,
                   how=act.choices[inst_url].kind if inst_url in act.choices else "?",
                   decision_to_served_s=round(served_wall - decision_wall, 3))
        t = {"decision": decision_wall, "served": served_wall, "request_sent": sent_wall,
             "routable": routable.get(inst_url, float("nan"))}
        phases = STANDBY_PHASES
        if how != "standby":
            phases = PHASES
            t["spawn"] = base.started_at.get(inst_url, float("nan"))
            t.update(milestones(os.path.join(log_dir, f"sglang-plain-{inst_url.rsplit(':', 1)[1]}.log")))
        row["phases_s"] = {n: round(t[b] - t[a], 3) for n, a, b in phases if a in t and b in t}
        row["last_tries"] = [(round(w - decision_wall, 2), st, round(dt, 2)) for w, st, dt in tries]
        row["load_avg_1min_after"] = round(os.getloadavg()[0], 2)
    finally:
        await router.shutdown(2)
        await asyncio.to_thread(act.stop_all)
    return row


def release_probe(model: str, path: str, log_dir: str) -> dict[str, Any]:
    base = LocalProcessActuator(path, common_args=ARGS, env=ENV, log_dir=log_dir)
    url = base.add(Role.PLAIN)
    out: dict[str, Any] = {"model": model}
    try:
        base.wait_ready(url, 600)
        pid = base.procs[url].pid
        out["memory_bytes_ready"] = process_group_memory_bytes(pid)
        for step, endpoint, body_in in (("release", "/release_memory_occupation", {}),
                                        ("resume", "/resume_memory_occupation", {}),
                                        ("generate_after_resume", "/generate", BODY)):
            t0 = time.monotonic()
            try:
                status, body = http_json(url + endpoint, body_in, timeout_s=120)
            except OSError as exc:  # the CPU scheduler may die on release: record it, stop the probe
                out[step] = {"status": None, "seconds": round(time.monotonic() - t0, 3),
                             "answer": f"no answer: {type(exc).__name__}: {exc}"[:200],
                             "server_alive": base.alive(url)}
                break
            text = body.get("text") if isinstance(body, dict) and "text" in body else str(body)[:200]
            out[step] = {"status": status, "seconds": round(time.monotonic() - t0, 3), "answer": text}
            if step == "release":
                time.sleep(1)
                out["memory_bytes_released"] = process_group_memory_bytes(pid)
        log = open(os.path.join(log_dir, f"sglang-plain-{url.rsplit(':', 1)[1]}.log"), errors="replace").read()
        out["server_said"] = sorted({ln.split("] ", 1)[-1][:160] for ln in log.splitlines()
                                     if "memory_saver" in ln or "will not save memory" in ln})[:3]
    finally:
        base.stop_all()
    return out


def remote_instance_probe(model: str, path: str, log_dir: str) -> dict[str, Any]:
    """Start a seed, then a second server loading its weights from the seed (NCCL backend: the one
    SGLang 0.5.23 uses without a transfer engine). Records what happens."""
    from kllm_plugins.testing.sglang_server import free_port

    base = LocalProcessActuator(path, common_args=ARGS, env=ENV, log_dir=log_dir)
    seed = base.add(Role.PLAIN)
    out: dict[str, Any] = {"model": model, "backend": "nccl"}
    try:
        base.wait_ready(seed, 600)
        host, port = seed.rsplit(":", 1)
        target = LocalProcessActuator(path, common_args=[
            *ARGS, "--load-format", "remote_instance", "--remote-instance-weight-loader-seed-instance-ip", "127.0.0.1",
            "--remote-instance-weight-loader-seed-instance-service-port", port,
            "--remote-instance-weight-loader-send-weights-group-ports", f"[{free_port()}]"],
            env=ENV, log_dir=log_dir)
        url = target.add(Role.PLAIN)
        try:
            target.wait_ready(url, 300)
            out["outcome"] = "served"
        except (RuntimeError, TimeoutError) as exc:
            out["outcome"] = f"failed: {exc}"
        log = open(os.path.join(log_dir, f"sglang-plain-{url.rsplit(':', 1)[1]}.log"), errors="replace").read()
        errs = [ln.strip()[:240] for ln in log.splitlines()
                if re.search(r"Error|assert|only supports|not supported|Fallback", ln)]
        out["errors"] = errs[:4]
        target.stop_all()
    finally:
        base.stop_all()
    return out


def spread(vals: list[float]) -> dict[str, float]:
    """The harness's spread over repeats (median, min/max, p10/p90; the repeats are in the rows) and n."""
    s = stats.spread(vals)
    return {k: round(s[k], 3) for k in ("median", "min", "max", "p10", "p90")} | {"n": len(vals)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=list(MODELS)[:2], choices=list(MODELS))
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--paths", nargs="*", default=["cold", "warm", "standby"], choices=["cold", "warm", "standby"],
                    help="none: only the probes")
    ap.add_argument("--probes", nargs="*", default=["release", "remote_instance"],
                    choices=["release", "remote_instance"])
    ap.add_argument("--timeout-s", type=float, default=600)
    ap.add_argument("--no-record", action="store_true")
    ap.add_argument("--from-log", default="",
                    help="record the rows and probes a run printed to this log (a run cut before its first "
                         "repeat ended recorded nothing) instead of starting servers")
    args = ap.parse_args()
    if args.from_log:
        rows, probes = rows_from_log(args.from_log)
        record_run(args, summarize(args, rows), rows, probes, time.time())
        return
    log_dir = tempfile.mkdtemp(prefix="kllm-tts-")
    rows: list[dict[str, Any]] = []
    probes: list[dict[str, Any]] = []
    t_start = time.time()
    for model in args.models:
        path = model_path(model)
        for rep in range(args.repeats):
            for how in args.paths:  # interleaved: cold, warm, standby, cold, ...
                row = asyncio.run(one_start(model, path, how, log_dir, args.timeout_s))
                row["repeat"] = rep
                rows.append(row)
                print(json.dumps(row), flush=True)
            if not args.no_record:  # after every repeat: a run cut short keeps what it measured
                record_run(args, summarize(args, rows, quiet=True), rows, probes, t_start)
        for probe in args.probes:
            probes.append(dict(release_probe(model, path, log_dir) if probe == "release"
                               else remote_instance_probe(model, path, log_dir), probe=probe))
            print(json.dumps(probes[-1]), flush=True)
            if not args.no_record:
                record_run(args, summarize(args, rows, quiet=True), rows, probes, t_start)
    summary = summarize(args, rows)
    if args.no_record:
        return
    record_run(args, summary, rows, probes, t_start)


def rows_from_log(path: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The start rows and probe entries main() printed (one JSON object per line) in a run's log."""
    rows: list[dict[str, Any]] = []
    probes: list[dict[str, Any]] = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.startswith("{"):
                continue
            item = json.loads(line)
            (probes if "probe" in item else rows if "path" in item else []).append(item)
    if not rows and not probes:
        raise SystemExit(f"{path}: no start rows or probes in this log")
    return rows, probes


def summarize(args: argparse.Namespace, rows: list[dict[str, Any]], quiet: bool = False) -> dict[str, Any]:
    """Per model and path: spreads of each phase over repeats, and ratios to cold (printed unless quiet)."""
    say = (lambda *a: None) if quiet else print
    summary: dict[str, Any] = {}
    say(f"\n{LABEL}; seconds from the scale-up decision, median (min-max) over repeats")
    for model in args.models:
        summary[model] = {}
        cols = [h for h in args.paths if any(r["model"] == model and r["path"] == h for r in rows)]
        say(f"\n{model}: " + " | ".join(f"{h:>22}" for h in cols))
        names = [n for n, _, _ in PHASES] + ["promote_and_register", "decision_to_served_s"]
        for name in names:
            cells = []
            for h in cols:
                sel = [r for r in rows if r["model"] == model and r["path"] == h]
                vals = [r[name] if name == "decision_to_served_s" else r["phases_s"].get(name) for r in sel]
                vals = [v for v in vals if v is not None]
                if vals:
                    s = summary[model].setdefault(h, {})[name] = spread(vals)
                    cells.append(f"{s['median']:>8.2f} ({s['min']:.2f}-{s['max']:.2f})")
                else:
                    cells.append(f"{'-':>22}")
            if any(c.strip() != "-" for c in cells):
                say(f"  {name:<22} " + " | ".join(f"{c:>22}" for c in cells))
        for h in cols:
            if h != "cold" and "cold" in summary[model] and h in summary[model]:
                ratio = summary[model][h]["decision_to_served_s"]["median"] / summary[model]["cold"][
                    "decision_to_served_s"]["median"]
                summary[model][h]["vs_cold_median_ratio"] = round(ratio, 4)
                per = {p: [r["decision_to_served_s"] for r in rows if r["model"] == model and r["path"] == p
                           and r.get("decision_to_served_s") is not None] for p in (h, "cold")}
                if per[h] and per["cold"]:  # ratio of medians with its spread (paired by repeat when it can be)
                    summary[model][h]["vs_cold"] = {k: v for k, v in stats.ratio_of_medians(per[h], per["cold"]).items()
                                                    if k != "per_repeat"}
                say(f"  {h} / cold (medians): {ratio:.3f}x")
    return summary


def record_run(args: argparse.Namespace, summary: dict[str, Any], rows: list[dict[str, Any]],
               probes: list[dict[str, Any]], t_start: float) -> None:
    """One summary for every model and path: this run replaces the (model, path) cells and the
    (model, probe) entries it measured; the others stay, each with the run that measured it."""
    from kllm_plugins.bench.record import build_summary, git_commit, result_path, write_summary

    path = result_path("bigpd_router", RESULT_NAME, RESULTS_ROOT)
    old: dict[str, Any] = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
    command = " ".join(["python", *sys.argv])
    # rows recorded --from-log belong to the device run's commit ($KLLM_COMMIT), not this checkout's
    commit = (os.environ.get("KLLM_COMMIT") if args.from_log else None) or git_commit()
    run = {"command": command, "commit": commit,
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t_start))}
    metrics: dict[str, Any] = dict(old.get("metrics") or {})
    for earlier in old.pop("runs", []):  # the layout before results/<plugin>/<name>.json: one entry per run
        erun = {"command": earlier.get("command"), "commit": earlier.get("commit"), "date": earlier.get("date_utc")}
        for model, cells in (earlier.get("summary") or {}).items():
            for how, cell in cells.items():
                metrics.setdefault(model, {})[how] = {**cell, "run": erun}
        old.setdefault("starts", []).extend({**r, "run": erun} for r in earlier.get("starts", []))
    for model, cells in summary.items():
        for how, cell in cells.items():
            metrics.setdefault(model, {})[how] = {**cell, "run": run}
    keep_rows = [r for r in old.get("starts", []) if (r.get("model"), r.get("path")) not in
                 {(r2["model"], r2["path"]) for r2 in rows}]
    keep_probes = [p for p in old.get("probes", []) if (p.get("model"), p.get("probe")) not in
                   {(p2["model"], p2["probe"]) for p2 in probes}]
    for p in probes:
        p["run"] = run
    for r in rows:
        r["run"] = run
    data = build_summary(
        command, metrics, shared=SHARED, machine=MACHINE, commit=commit,
        notes=PLATFORM_NOTE + "; seconds from the scale-up decision to the first request served through "
              "the router, median (min-max) over interleaved repeats. Each cell names the run that measured "
              "it (metrics.<model>.<path>.run).",
        simulated=False, router={"health_interval_s": 0.5, "scale_interval_s": 0.25},
        starts=[*keep_rows, *rows], probes=[*keep_probes, *probes])
    write_summary(path, data)
    print(f"\nrecorded {path}")


if __name__ == "__main__":
    main()
