"""Replay shared-prefix multi-turn traces against two real SGLang servers per setup on CPU: L1 only
vs stock HiCache (L2 + SGLang's file L3) vs kv_tiers (L2 + checked file L3, fetch-or-recompute,
selective writes under pressure), the L3 folder shared by a setup's two servers.

Sizes, the same for every setup: L1 (device KV) `--l1-tokens` per server; L2 (host) `--hicache-ratio`
2 = 2x L1 per server; L3 a folder shared by the two servers, unbounded for stock HiCache (SGLang's
file backend has no bound) and `store_capacity_gb` (16 GiB, never reached here) for kv_tiers.

Setups are interleaved: repeat 1 runs them in the order A B C, repeat 2 C B A (and so on), so a
drift of the shared machine hits every setup alike; a setup's two servers start fresh for each of
its turns (consecutive turns of one setup share a start). Six servers at once do not fit: SGLang
refuses a host pool while less than 10 GiB of the machine is free. Each measurement cell
(repeat, trace, load step) uses its own token space (fresh block ids, the same in every setup)
and starts with L1 and L2 flushed, so nothing carries over from an earlier cell (L3 keeps old
pages, which no later cell can match).

Each server runs `--server-threads` OpenMP / torch threads (default 1): two servers with torch's
default (one thread per core) oversubscribe this 2-core machine, and the serial cell then measured
spin-waiting rather than caching (docs/kv_tiers.md, "Slow L3 medium, run 2"). Servers are idle
between cells (measured: under 0.1 core within 0.5 s of a cell's last response; SGLang flushes only
an idle server and HiCache's reset drops queued storage work), so the order of the cells does not
carry work over from one to the next.

A request goes to a server picked by a seeded coin (a load balancer that knows nothing of
prefixes; the same picks in every setup), so about half of a conversation's turns land on the
other server: there only a shared L3 can serve its prefix. Traces: synthetic (trace_gen, Mooncake
format), ShareGPT-derived (sharegpt_trace, real multi-turn conversations) and a no-reuse control.

Measured per setup and trace, per repeat (medians over repeats with [min, max]):
- hit rate per tier from SGLang's per-request breakdown (`cached_tokens_details`: device = L1,
  host = L2, storage = L3) and TTFT mean/P50/P99, with one request in flight per server (the
  "serial" cell: deterministic hits);
- under load, an open-loop arrival schedule per rate in `--rates` (total req/s over both servers;
  Poisson, seeded, identical for every setup): TTFT P50/P90 and throughput = completed requests /
  (last completion - first arrival). Throughput at the TTFT SLO: the highest rate step's throughput
  whose TTFT P90 is within the SLO (0 if none). An open loop offers every setup the same work at the
  same instants, so a setup cannot look faster by being sent less; the closed-loop ladder used
  before let one slow response delay the next request of its client and moved up to 5x between
  repeats on this shared 2-core machine.
- the no-reuse control (`unique`) runs first in each server lifetime (after a warm-up of unique
  requests), so kv_tiers meets it cold, as a server whose workload has no reuse.
With `--pressure`, a second part bounds kv_tiers' L3 below what the trace writes and compares
writing every page (`min_reuse` 1, LRU eviction) against the plugin's selection (see pressure.py).
Prints the setups side by side with ratios and writes benchmarks/results/kv_tiers/<--results-name>.json
through the harness's recorder. `--deadline-s` stops starting server lifetimes that would not finish
in time, and every finished lifetime's cells are saved to `--partial` as they come.

With `--l3-latency-ms` / `--l3-mb-s`, stock HiCache and kv_tiers both put L3 on an emulated slow
medium: every page read and existence check sleeps latency + bytes / bandwidth, at the storage-backend
layer of each (SGLang's `HiCacheFile` and the plugin's file store subclassed in slow_medium.py, loaded
through HiCache's `dynamic` backend); the regime where an L3 hit costs more than recomputing it.

Stock HiCache is stock: no plugin enabled, SGLang's own `file` backend in the shared folder
(`SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR`); what lets HiCache run on this CPU platform at all
(unpinned host pool, a torch direct copy) is the platform's own patch list, applied with or without
any plugin.
"""
from __future__ import annotations

import argparse
import contextlib
import re
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

from kllm_plugins.models.tiny_llama import tiny_llama_path
from kllm_plugins.plugins.kv_tiers.testing import flush, kv_tiers_stats, l3_args
from kllm_plugins.testing.sglang_server import SGLangServer, start_all

sys.path.insert(0, str(Path(__file__).parent))
from replay import arrivals, assign, measure, replay_open, replay_serial, spread  # noqa: E402
from medium_report import medium_delta  # noqa: E402
from medium_setup import medium_setup_args, medium_stats  # noqa: E402
from trace_gen import generate  # noqa: E402
from bench_report import plot, record, report, slo_crossing  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SERVER_ARGS = ("--page-size", "16", "--chunked-prefill-size", "512")
SPACE = 1 << 24  # block ids per token space (one space per measurement cell)


def setup_args(name: str, store: str, args: argparse.Namespace | None = None, stats_dir: str = "",
               **l3_extra: Any) -> tuple[list[str], list[str], dict[str, str]]:
    """Server flags, plugins and environment of a setup; `l3_extra` goes into HiCache's storage
    extra config (e.g. `prefetch_threshold`) of the file-store setups."""
    env = {"KLLM_EXTRA_PLUGINS": "kllm_plugins.plugins.kv_tiers.hookimpls"}
    if name.startswith("kv_tiers[") and name.endswith("]"):  # diagnostic: kv_tiers[option=value,...]
        for pair in name[len("kv_tiers["):-1].split(","):
            option, value = pair.split("=", 1)
            env[f"KLLM_KV_TIERS_{option.strip().upper()}"] = value.strip()
        name = "kv_tiers"
    if name == "l1_only":
        return [], [], {}
    if args is not None and args.medium is not None:  # both L3 setups on the emulated slow medium
        flags, menv = medium_setup_args(name, store, args.medium["latency_ms"], args.medium["mb_s"], stats_dir)
        if name == "hicache":
            return flags, [], menv
        env.update(menv)
        env["KLLM_KV_TIERS_STORE_DIR"] = store
        if name == "kv_tiers_fixed":
            env["KLLM_KV_TIERS_ADAPTIVE_THRESHOLDS"] = "false"
        return flags, ["kv_tiers"], env
    if name == "hicache":  # stock: SGLang's own file backend, no plugin (the CPU platform's patches run HiCache)
        return l3_args("file", **l3_extra), [], {"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": store}
    env.update({"KLLM_KV_TIERS_STORE_DIR": store})
    if name == "kv_tiers_fixed":  # diagnostic: the plugin's store with stock's fixed thresholds
        env["KLLM_KV_TIERS_ADAPTIVE_THRESHOLDS"] = "false"
    return l3_args("kllm_file", **l3_extra), ["kv_tiers"], env


def split_setups(text: str) -> list[str]:
    """Comma-separated setup names; commas inside a diagnostic's brackets (`kv_tiers[a=1,b=2]`) stay."""
    return [m.strip() for m in re.findall(r"[^,\[]+(?:\[[^\]]*\])?", text) if m.strip()]


def server_thread_env(threads: int) -> dict[str, str]:
    """Each server's OpenMP / torch intra-op threads (0: inherit, torch's default = one per core).
    A setup runs two servers on this 2-core machine; with torch's default each prefills with 2 OpenMP
    threads, so 4 spin-waiting threads share 2 cores: the same serial cell then took ~10x the CPU
    seconds and ~10x the TTFT, and identical cells in one server lifetime differed by 25%."""
    return {} if threads <= 0 else {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


def cpu_server(plugins: list[str], extra: list[str], env: dict[str, str], l1_tokens: int, tag: str) -> SGLangServer:
    """One server of a setup on this CPU: the tiny model on the kllm_cpu platform."""
    return SGLangServer(tiny_llama_path(), plugins=plugins, extra_args=[*SERVER_ARGS, *extra], env=env,
                        max_total_tokens=l1_tokens, startup_timeout_s=400)


SERVER_FACTORY = cpu_server
"""Builds a setup's servers; benchmarks/gpu/kv_tiers_gpu.py puts the GPU's (8B-shaped model on kllm_cuda) here."""


def setup_servers(name: str, store: str, args: argparse.Namespace | None, mdir: str, l1_tokens: int,
                  threads: int, count: int = 2, **l3_extra: Any) -> tuple[list[SGLangServer], list[str]]:
    """A setup's `count` servers (not started) sharing one L3 `store`, and their plugins."""
    extra, plugins, env = setup_args(name, store, args, mdir, **l3_extra)
    dtype = getattr(args, "dtype", "") if args is not None else ""
    extra = [*extra, *(("--dtype", dtype) if dtype else ())]
    servers = [SERVER_FACTORY(plugins, list(extra), {**env, **server_thread_env(threads), "KLLM_KV_TIERS_INSTANCE_ID": f"{name}-{i}"},
                              l1_tokens, f"{name}-{i}") for i in range(count)]
    return servers, plugins


def summarize(name: str, tname: str, cells: dict[tuple[Any, int], dict[str, Any]], args: argparse.Namespace,
              stats: list[dict[str, Any]]) -> dict[str, Any]:
    """cells[(step, repeat)] -> measure(), step "serial" or a rate; the issue's fields plus detail."""
    reps = sorted({r for st, r in cells if st == "serial"})
    base = [cells[("serial", r)] for r in reps]
    rates = [x for x in args.rate_list if all((x, r) in cells for r in reps)]
    at_slo, crossing = [], []
    for r in reps:  # a repeat's ladder may have stopped early (--stop-after-misses): its own steps count
        pts = [(cells[(x, r)]["throughput_req_s"], cells[(x, r)]["ttft_s"]["p90"])
               for x in args.rate_list if (x, r) in cells]
        ok = [thr for thr, p90 in pts if p90 <= args.slo_s]
        at_slo.append(max(ok) if ok else 0.0)
        crossing.append(slo_crossing(pts, args.slo_s))
    hit = {k: statistics.median(m["hit_rate"][k] for m in base) for k in ("l1", "l2", "l3", "total")}
    ttft = {k: statistics.median(m["ttft_s"][k] for m in base) for k in ("mean", "p50", "p99")}
    return {
        "setup": name,
        "trace": tname,
        "hit_rate": hit,
        "ttft_s": ttft,
        "throughput_at_slo_req_s": statistics.median(at_slo) if at_slo else 0.0,
        "throughput_at_slo_interp_req_s": statistics.median(crossing) if crossing else 0.0,
        "servers": args.servers,
        "requests": base[0]["requests"],
        "repeats": len(reps),
        "slo": {"ttft_s": args.slo_s, "percentile": args.slo_pct},
        "sizes_tokens_per_server": {"l1": args.l1_tokens, "l2": 2 * args.l1_tokens if name != "l1_only" else 0,
                                    "l3": "shared folder" if name != "l1_only" else 0},
        "spread": {"ttft_mean_s": spread([m["ttft_s"]["mean"] for m in base]),
                   "ttft_p50_s": spread([m["ttft_s"]["p50"] for m in base]),
                   "ttft_p99_s": spread([m["ttft_s"]["p99"] for m in base]),
                   "throughput_at_slo_req_s": spread(at_slo),
                   "throughput_at_slo_interp_req_s": spread(crossing),
                   "hit_total": spread([m["hit_rate"]["total"] for m in base])},
        "open_loop": [{"rate_req_s": x,
                       "throughput_req_s": spread([cells[(x, r)]["throughput_req_s"] for r in reps]),
                       "ttft_p50_s": spread([cells[(x, r)]["ttft_s"]["p50"] for r in reps]),
                       "ttft_p90_s": spread([cells[(x, r)]["ttft_s"]["p90"] for r in reps]),
                       "ttft_mean_s": spread([cells[(x, r)]["ttft_s"]["mean"] for r in reps])} for x in rates],
        "kv_tiers_stats": stats,
        # L1->L2 copy bandwidth inside the servers (device-timed; GPU runs of the staged copier only)
        "l2_backup_device_gbps": spread(bw) if (bw := [x["l2_backup_device_gbps"] for x in stats
                                                       if x.get("l2_backup_device_gbps")]) else None,
        # per repeat, both servers' cumulative L3 path counters after this trace's last cell (the
        # no-reuse trace runs first after a start: its figures are the warm-up's plus its own)
        # the slow medium's calls / bytes / seconds charged per cell (both servers), when it is on
        "medium_per_cell": [{"step": st, "repeat": r, **m["medium_cell"]} for (st, r), m in sorted(
            cells.items(), key=lambda x: (x[0][1], x[0][0] != "serial", str(x[0][0]))) if "medium_cell" in m],
        "l3_path_after_trace": [cells[(last, r)].get("kv_tiers_after") for r in reps
                                for last in [max((st for st, rr in cells if rr == r), key=lambda x: (x != "serial", x))]],
    }


def build_traces(args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    # a context per conversation (`--groups` = sessions: none shared across conversations) makes
    # recomputing a returning conversation's prefix the dominant cost, which is what tiers save
    gen = {"groups": args.groups or args.sessions, "system_blocks": args.system_blocks,
           "user_blocks": args.user_blocks, "answer_blocks": args.answer_blocks}
    default_gen = {"groups": 3, "system_blocks": 8, "user_blocks": 4, "answer_blocks": 2}
    if not args.groups and gen | {"groups": 3} == default_gen:
        gen["groups"] = 3  # the earlier runs' shape
    shape = "" if gen == default_gen else (f" groups={gen['groups']} blocks={args.system_blocks}"
                                          f"+{args.user_blocks}/+{args.answer_blocks}")
    sg = "" if (args.sg_max_tokens, args.sg_min_tokens) == (768, 0) else (
        f" tokens {args.sg_min_tokens}-{args.sg_max_tokens}")
    for t in args.traces.split(","):
        if t == "synthetic":
            out[f"synthetic sessions={args.sessions} turns={args.turns}{shape}"] = list(
                generate(args.sessions, args.turns, **gen))
        elif t == "sharegpt":
            from sharegpt_trace import build

            out[f"sharegpt conversations={args.conversations} turns<=3{sg}"] = build(
                args.conversations, max_tokens=args.sg_max_tokens, min_tokens=args.sg_min_tokens)
        elif t == "unique":
            out[f"synthetic sessions={args.sessions} turns={args.turns}{shape} unique"] = list(
                generate(args.sessions, args.turns, unique=True, **gen))
        else:
            raise SystemExit(f"unknown trace {t!r}")
    return out


def kept_stats(servers: list[SGLangServer]) -> list[dict[str, Any]]:
    keep = ("pages_admitted", "pages_skipped", "prefetch_admitted", "prefetch_refused", "prefetch_explored",
            "l2_explored", "l2_loaded_tokens",
            "path_s", "path_calls", "write_mode", "prefetch_wait", "l2_backup_tokens", "l2_backup_device_tokens",
            "l2_backup_device_bytes", "prefetch_probe_miss",
            "held_written", "held", "admission_holds", "prefetch_deferred", "prefetch_reissued",
            "l2_backup_device_gbps", "l2_index_host_copies_skipped", "l2_backup_copies")
    fkeys = ("l3_bandwidth_bytes_per_s", "l3_latency_s", "l3_samples", "prefill_samples", "l2_min_fetch_tokens",
             "l3_prefetch_overhead_busy_s", "l3_prefetch_waits", "l3_prefetch_waits_busy", "l3_min_fetch_tokens_busy")
    out = []
    for s in servers:
        st = kv_tiers_stats(s)
        dev_s = (st.get("path_s") or {}).get("l2_backup_device") or 0.0
        # the L1->L2 copy bandwidth inside the server: bytes over the copies' device time (GPU only)
        st["l2_backup_device_gbps"] = round(st.get("l2_backup_device_bytes", 0) / dev_s / 1e9, 2) if dev_s else None
        store = st.get("store", {})
        fp = st.get("fetch_policy", {})
        out.append({k: v for k, v in st.items() if k in keep or k.startswith(("l2_backup_calls_", "l2_backup_bytes_",
                                                                               "l2_backup_us_"))}
                   | {"store_hits": store.get("hits"), "store_put_bytes": store.get("put_bytes"),
                      "store_put_existing": store.get("put_existing"),
                      "l3_min_fetch_tokens": fp.get("l3_min_fetch_tokens"),
                      "l3_prefetch_overhead_s": fp.get("l3_prefetch_overhead_s"),
                      "prefill_tokens_per_s": fp.get("prefill_tokens_per_s")}
                   | {k: fp.get(k) for k in fkeys}
                   # the plugin's "L3 slower than recomputing" turns (metric label l3_slower_than_recompute)
                   | {"l3_slower_than_recompute_logs": len(s.grep_log("l3 is slower than recomputing"))})
    return out


def lifetimes(setups: list[str], repeats: int, keep_apart: tuple[str, ...] = ()) -> list[tuple[str, list[int]]]:
    """Setups in the order A B C, C B A, A B C ... (one entry per repeat), with consecutive runs of
    one setup merged into one server lifetime (except setups in `keep_apart`): [(setup, [repeats])]."""
    seq = [(n, rep) for rep in range(repeats) for n in (setups if rep % 2 == 0 else setups[::-1])]
    out: list[tuple[str, list[int]]] = []
    for n, rep in seq:
        if out and out[-1][0] == n and n not in keep_apart:
            out[-1][1].append(rep)
        else:
            out.append((n, [rep]))
    return out


def save_partial(args: argparse.Namespace, cells: dict[tuple[str, str], dict[tuple[Any, int], dict[str, Any]]],
                 stats: dict[str, list[dict[str, Any]]], extra: dict[str, Any] | None = None) -> None:
    if not args.partial:
        return
    doc = {"cells": [{"setup": n, "trace": t, "step": st, "repeat": r, **m}
                     for (n, t), cl in cells.items() for (st, r), m in cl.items()], "stats": stats, **(extra or {})}
    Path(args.partial).write_text(json.dumps(doc, indent=1) + "\n")


def load_partial(path: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The runs of a `--partial` file (a run that stopped after its last lifetime, e.g. in plotting),
    summarized as `run` does; `args` must be the run's own."""
    doc = json.loads(Path(path).read_text())
    cells: dict[tuple[str, str], dict[tuple[Any, int], dict[str, Any]]] = {}
    for c in doc["cells"]:
        c = dict(c)
        key = (c.pop("setup"), c.pop("trace"))
        cells.setdefault(key, {})[(c.pop("step"), c.pop("repeat"))] = c
    stats = doc.get("stats", {})
    return [summarize(n, t, cl, args, stats.get(n, [])) for (n, t), cl in cells.items()
            if any(st == "serial" for st, _ in cl)]


def run(args: argparse.Namespace, traces: dict[str, list[dict[str, Any]]], t_start: float
        ) -> list[dict[str, Any]]:
    setups = split_setups(args.setups)
    cells: dict[tuple[str, str], dict[tuple[Any, int], dict[str, Any]]] = {}
    stats: dict[str, list[dict[str, Any]]] = {}
    tnames = list(traces)
    # kv_tiers restarts for every repeat, so each repeat meets the no-reuse control right after a start
    # (its write-all rule keeps a window of recent lookups); the other setups keep no such state
    plan = lifetimes(setups, args.repeats, keep_apart=tuple(setups) if args.restart_each_repeat else ("kv_tiers",))
    steps: list[Any] = ["serial", *args.rate_list]
    seen_s: list[float] = []  # wall seconds per setup-repeat so far (start included)
    # Every lifetime's L3 folder lives under one run folder, deleted only when the run ends: deleting
    # a store of tens of thousands of page files mid-run made creating files near it 10-60x slower
    # for minutes on this ext4 disk (1.1 ms per create instead of 0.02 ms), and that bill went to
    # the setup that ran next (long13: kv_tiers after stock HiCache wrote 4-5 s instead of ~1 s).
    disk: list[dict[str, Any]] = []  # per lifetime: the create cost measured before its start
    with run_folder("kvt-bench-run-", args.store_root) as run_root:
        total = sum(len(reps) for _, reps in plan)
        done = 0
        for name, reps in plan:
            per = time.perf_counter() - t_start
            need = max(seen_s + [args.lifetime_s if not seen_s else 0.0]) * len(reps)
            if per + need > args.deadline_s:
                print(f"== deadline: {name} repeats {reps} not run ({per:.0f} s spent, {need:.0f} s needed)",
                      file=sys.stderr)
                continue
            t_life = time.perf_counter()
            store = tempfile.mkdtemp(prefix=f"{name}-", dir=run_root)
            mdir = tempfile.mkdtemp(prefix=f"kvt-medium-{name}-") if args.medium is not None else ""
            disk.append({"setup": name, "repeats": reps, "create_ms": round(create_cost_ms(store), 4)})
            print(f"== {name}: creating a page file costs {disk[-1]['create_ms']:.3f} ms here", file=sys.stderr)
            servers, plugins = setup_servers(name, store, args, mdir, args.l1_tokens, args.server_threads,
                                             args.servers)
            urls = [s.base_url for s in servers]
            prev_medium: list[dict[str, Any]] | None = None
            try:
                t0 = time.perf_counter()
                start_all(servers)
                # warm-up in token space 0 (no cell uses it): the first requests after a start are slower
                # (allocations, first batches); taken from the first trace (the no-reuse control when it runs)
                mine = [t for t in tnames if not t.endswith(" unique") or name in split_setups(args.unique_setups)]
                warm = traces[mine[0]][: args.warmup]
                replay_serial(urls, warm, assign(len(warm), len(servers), args.seed), 0)
                print(f"== {name}: servers up in {time.perf_counter() - t0:.0f} s, repeats {reps}", file=sys.stderr)
                for rep in reps:
                    for k, tname in enumerate(tnames):
                        if tname not in mine:
                            continue
                        trace = traces[tname]
                        picks = assign(len(trace), len(servers), args.seed)
                        misses = 0  # consecutive rate steps over the SLO in this repeat's ladder
                        for j, step in enumerate(steps):
                            if step != "serial" and args.stop_after_misses and misses >= args.stop_after_misses:
                                print(f"  rep {rep} {tname}: rates from {step} not run ({misses} misses in a row)",
                                      file=sys.stderr)
                                break
                            for s in servers:
                                flush(s.base_url)
                            time.sleep(args.settle_s)
                            space = 1 + (rep * len(tnames) + k) * len(steps) + j  # same cell, same tokens
                            if step == "serial":
                                res, makespan = replay_serial(urls, trace, picks, space * SPACE)
                            else:
                                sched = arrivals(len(trace), float(step), args.seed + rep, args.scaled_schedule)
                                res, makespan = replay_open(urls, trace, picks, sched, space * SPACE)
                            m = measure(res, makespan, args.slo_pct)
                            if step == "serial":  # per request (TTFT, tokens per tier, server): in --partial only
                                m["per_request"] = res
                            if plugins:  # this plugin's L3 path so far (cumulative per server; deltas per cell)
                                time.sleep(0.6)  # stats snapshots are written every 0.5 s
                                m["kv_tiers_after"] = kept_stats(servers)
                            if mdir:  # the medium's counters per server process (cumulative; deltas per cell)
                                if not plugins:
                                    time.sleep(0.2)
                                m["medium_after"] = medium_stats(mdir)
                                m["medium_cell"] = medium_delta(prev_medium, m["medium_after"])
                                prev_medium = m["medium_after"]
                            cells.setdefault((name, tname), {})[(step, rep)] = m
                            if step != "serial":
                                misses = misses + 1 if m["ttft_s"]["p90"] > args.slo_s else 0
                            print(f"  rep {rep} {tname} {step}: {makespan:.1f} s, hit {m['hit_rate']['total']:.3f} "
                                  f"(l1 {m['hit_rate']['l1']:.3f} l2 {m['hit_rate']['l2']:.3f} "
                                  f"l3 {m['hit_rate']['l3']:.3f}), "
                                  f"TTFT mean {m['ttft_s']['mean']:.3f} p50 {m['ttft_s']['p50']:.3f} "
                                  f"p90 {m['ttft_s']['p90']:.3f}, {m['throughput_req_s']:.2f} req/s",
                                  file=sys.stderr, flush=True)
                    done += 1
                    print(f"  [{done}/{total}] setup-repeats done at {time.perf_counter() - t_start:.0f} s",
                          file=sys.stderr, flush=True)
                if plugins:
                    time.sleep(1.0)  # stats snapshots are written every 0.5 s
                    stats.setdefault(name, []).extend(kept_stats(servers))
                seen_s.append((time.perf_counter() - t_life) / len(reps))
            finally:
                for s in servers:
                    s.stop()
                os.sync()  # the next lifetime starts with this one's writes on disk (its folder stays)
                if mdir:
                    shutil.rmtree(mdir, ignore_errors=True)
            save_partial(args, cells, stats, {"disk": disk})
    return [summarize(n, t, cl, args, stats.get(n, [])) for (n, t), cl in cells.items()
            if any(st == "serial" for st, _ in cl)]


@contextlib.contextmanager
def run_folder(prefix: str, root: str = "") -> Iterator[str]:
    """A folder for a run's L3 folders (under `root`, default the system temp folder), deleted when
    the run ends and not before: deleting a store of many page files mid-run slows file creation
    near it for minutes on this disk, a cost the next setup would pay."""
    path = tempfile.mkdtemp(prefix=prefix, dir=root or None)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def create_cost_ms(folder: str, files: int = 200, size: int = 32 << 10) -> float:
    """Median milliseconds to create, write and rename one page-sized file in `folder` (the cost
    a file L3 pays per written page), measured in a scratch folder removed afterwards."""
    scratch = tempfile.mkdtemp(prefix="create-probe-", dir=folder)
    buf = b"\0" * size
    times = []
    try:
        for i in range(files):
            t0 = time.perf_counter()
            tmp = os.path.join(scratch, f"{i}.tmp")
            with open(tmp, "wb") as f:
                f.write(buf)
            os.replace(tmp, os.path.join(scratch, str(i)))
            times.append(time.perf_counter() - t0)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description="kv_tiers: L1 only vs stock HiCache vs kv_tiers, two servers each, "
                                             "interleaved repeats")
    ap.add_argument("--setups", default="l1_only,kv_tiers,hicache",
                    help="in this order A B C, then C B A, ... (kv_tiers in the middle never shares a start)")
    ap.add_argument("--traces", default="unique,synthetic,sharegpt")
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--conversations", type=int, default=12)
    ap.add_argument("--groups", type=int, default=0,
                    help="synthetic: conversations sharing a system context (0: 3 for the default shape, "
                         "else one context per session)")
    ap.add_argument("--system-blocks", type=int, default=8, help="synthetic: context blocks (16 tokens each)")
    ap.add_argument("--user-blocks", type=int, default=4, help="synthetic: new user blocks per turn")
    ap.add_argument("--answer-blocks", type=int, default=2, help="synthetic: answer blocks kept in the history")
    ap.add_argument("--sg-max-tokens", type=int, default=768, help="ShareGPT: longest history kept (tokens)")
    ap.add_argument("--sg-min-tokens", type=int, default=0,
                    help="ShareGPT: keep conversations whose last kept turn is at least this long")
    ap.add_argument("--results-name", default="bench_tiers", help="benchmarks/results/kv_tiers/<name>.json")
    ap.add_argument("--unique-setups", default="l1_only,kv_tiers", help="setups that also run the no-reuse trace")
    ap.add_argument("--rates", default="2.5,5", help="open-loop arrival rates (req/s over both servers)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--servers", type=int, default=2, help="servers per setup (one alone on a GPU: nothing shares "
                    "its PCIe link or its device time)")
    ap.add_argument("--l1-tokens", type=int, default=1024, help="--max-total-tokens (device KV) per server")
    ap.add_argument("--slo-s", type=float, default=2.0, help="TTFT SLO")
    ap.add_argument("--slo-pct", type=float, default=0.9, help="TTFT percentile held to the SLO")
    ap.add_argument("--settle-s", type=float, default=0.5, help="pause after each flush")
    ap.add_argument("--warmup", type=int, default=8, help="requests replayed after each start, not measured")
    ap.add_argument("--seed", type=int, default=0, help="seed of the request-to-server coin and the schedules")
    ap.add_argument("--deadline-s", type=float, default=1e9, help="start no server lifetime expected to end later")
    ap.add_argument("--lifetime-s", type=float, default=240.0,
                    help="expected seconds per setup-repeat until one is measured (deadline)")
    ap.add_argument("--pressure", action="store_true", help="also run the L3-under-pressure comparison")
    ap.add_argument("--pressure-capacity-mb", type=float, default=4.0, help="kv_tiers L3 bound per instance there")
    ap.add_argument("--store-root", default="",
                    help="folder for the run's L3 folders (default: the system temp folder); a folder of its "
                         "own on the disk keeps other files' deletions from slowing page-file creation")
    ap.add_argument("--partial", default="", help="save every finished lifetime's cells here")
    ap.add_argument("--plot", default="", help="draw TTFT P90 against throughput per setup to this file")
    ap.add_argument("--l3-latency-ms", type=float, default=None,
                    help="emulated slow L3 medium for hicache and kv_tiers: ms per page read / existence check")
    ap.add_argument("--l3-mb-s", type=float, default=None,
                    help="emulated slow L3 medium: MB/s of page reads (0: no bandwidth limit)")
    ap.add_argument("--l3-calib", default="",
                    help="calib_medium.py --out files (comma-separated) to keep with the medium in the results json")
    ap.add_argument("--dtype", default="", choices=("", "float32", "bfloat16"),
                    help="the servers' --dtype (default: the model's own; the tiny model's is bfloat16, and on a host without "
                         "native bf16, float32 prefills about 3x faster)")
    ap.add_argument("--server-threads", type=int, default=1,
                    help="OpenMP / torch threads per server (0: inherit torch's default, one per core: two "
                         "servers then oversubscribe the cores, see server_thread_env)")
    ap.add_argument("--restart-each-repeat", action="store_true",
                    help="every setup starts fresh servers for each repeat (by default only kv_tiers does, the "
                         "others share a start between consecutive repeats): each repeat of every setup then "
                         "begins right after a start, and lifetime-to-lifetime spread shows in every setup")
    ap.add_argument("--scaled-schedule", action="store_true",
                    help="every rate step replays one seeded unit-rate Poisson schedule divided by the rate "
                         "(default: an independent draw per rate)")
    ap.add_argument("--stop-after-misses", type=int, default=0,
                    help="end a repeat's rate ladder after this many consecutive steps over the SLO (0: run "
                         "every rate); saves the overloaded steps of the slower setups")
    ap.add_argument("--no-record", action="store_true", help="do not write results files")
    ap.add_argument("--from-partial", default="",
                    help="run nothing: report and record the cells of this --partial file (give the run's own "
                         "other arguments; e.g. a run that stopped after measuring)")
    ap.add_argument("--results-root", default=str(ROOT), help="write results under this folder (smoke runs)")
    args = ap.parse_args()
    args.rate_list = [float(x) for x in args.rates.split(",") if x]
    on = args.l3_latency_ms is not None or args.l3_mb_s is not None
    args.medium = ({"latency_ms": args.l3_latency_ms or 0.0, "mb_s": args.l3_mb_s or 0.0,
                    "emulation": "time.sleep(latency + bytes / bandwidth) per page read and per existence check, "
                                 "at the storage-backend layer, identical for hicache and kv_tiers "
                                 "(benchmarks/kv_tiers/slow_medium.py); writes not delayed"} if on else None)
    if args.medium is not None and args.l3_calib:
        args.medium["calibration"] = [json.loads(Path(p).read_text()) for p in args.l3_calib.split(",")]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the servers on the way out
    t_start = time.perf_counter()
    command = "python " + " ".join([str(Path(sys.argv[0]))] + sys.argv[1:])
    pressure = None
    if args.pressure:
        from pressure import run_pressure

        pressure = run_pressure(args)  # first: its figures do not depend on the main part's
        print(pressure["summary"], flush=True)
        save_partial(args, {}, {}, {"pressure": pressure})
    traces = build_traces(args)
    if args.from_partial:
        runs = load_partial(args.from_partial, args)
        cut = sys.argv.index("--from-partial")
        command = "python " + " ".join([str(Path(sys.argv[0]))] + sys.argv[1:cut] + sys.argv[cut + 2:])
    else:
        runs = run(args, traces, t_start)
    report(runs, traces, args)
    if not args.no_record:
        record(runs, traces, args, command, pressure)
    if args.plot:
        plot(runs, args.plot)


if __name__ == "__main__":
    main()
