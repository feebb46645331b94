"""Unit tests (no SGLang): Kubernetes actuator against a local fake API server; local-process actuator."""
from __future__ import annotations

import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Iterator
from urllib.parse import parse_qs, urlsplit

import pytest

from kllm_plugins.plugins.bigpd_router.core.registry import Role

pytest.importorskip("kubernetes")

from kllm_plugins.plugins.bigpd_router.actuators.kubernetes_scale import (  # noqa: E402
    DELETION_COST,
    KubernetesActuator,
    PoolWorkload,
    make_api_client,
)
from kllm_plugins.plugins.bigpd_router.actuators.local_process import LocalProcessActuator  # noqa: E402


class FakeCluster:
    """Just enough of the Kubernetes API: Deployment scale subresource, pods, pod patch.

    Scaling a Deployment down deletes the pod with the lowest pod-deletion-cost, as the
    ReplicaSet controller does; scaling up creates pods that are Ready at once.
    """

    def __init__(self) -> None:
        self.deployments: dict[str, dict[str, Any]] = {}
        self.pods: dict[str, dict[str, Any]] = {}
        self.calls: list[tuple[str, str, str]] = []
        self._n = 0
        self.lock = threading.Lock()

    def add_deployment(self, name: str, app: str, replicas: int) -> None:
        self.deployments[name] = {"app": app, "replicas": 0}
        self.scale_to(name, replicas)

    def scale_to(self, name: str, n: int) -> None:
        dep = self.deployments[name]
        mine = [p for p in self.pods.values() if p["metadata"]["labels"]["app"] == dep["app"]]
        while len(mine) < n:
            self._n += 1
            pod = {"metadata": {"name": f"{name}-{self._n}", "namespace": "ns", "labels": {"app": dep["app"]},
                                "annotations": {}},
                   "status": {"podIP": f"10.0.0.{self._n}", "phase": "Running",
                              "conditions": [{"type": "Ready", "status": "True"}]}}
            self.pods[pod["metadata"]["name"]] = pod
            mine.append(pod)
        while len(mine) > n:
            victim = min(mine, key=lambda p: int(p["metadata"]["annotations"].get(DELETION_COST, "0")))
            mine.remove(victim)
            del self.pods[victim["metadata"]["name"]]
        dep["replicas"] = n

    def scale_obj(self, name: str) -> dict[str, Any]:
        dep = self.deployments[name]
        return {"apiVersion": "autoscaling/v1", "kind": "Scale", "metadata": {"name": name, "namespace": "ns"},
                "spec": {"replicas": dep["replicas"]},
                "status": {"replicas": dep["replicas"], "selector": f"app={dep['app']}"}}

    def handle(self, method: str, path: str, query: dict[str, list[str]], body: Any,
               ctype: str) -> tuple[int, Any]:
        parts = path.strip("/").split("/")
        with self.lock:
            self.calls.append((method, path, ctype))
            if parts[:3] == ["apis", "apps", "v1"] and parts[-1] == "scale":
                name = parts[6]
                if name not in self.deployments:
                    return 404, {"kind": "Status", "code": 404, "message": "not found"}
                if method == "PATCH":
                    self.scale_to(name, int(body["spec"]["replicas"]))
                return 200, self.scale_obj(name)
            if parts[:2] == ["api", "v1"] and parts[4] == "pods":
                if len(parts) == 5 and method == "GET":
                    sel = query.get("labelSelector", [""])[0]
                    key, _, val = sel.partition("=")
                    items = [p for p in self.pods.values() if p["metadata"]["labels"].get(key) == val]
                    return 200, {"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": items}
                if len(parts) == 6 and method == "PATCH":
                    pod = self.pods[parts[5]]
                    pod["metadata"]["annotations"].update(body["metadata"]["annotations"])
                    return 200, pod
        return 404, {"kind": "Status", "code": 404}


@pytest.fixture
def fake_cluster() -> Iterator[tuple[FakeCluster, str]]:
    cluster = FakeCluster()

    class Handler(BaseHTTPRequestHandler):
        def _do(self) -> None:
            u = urlsplit(self.path)
            n = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(n)) if n else None
            status, out = cluster.handle(self.command, u.path, parse_qs(u.query), body,
                                         self.headers.get("Content-Type", ""))
            data = json.dumps(out).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_PATCH = _do

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    try:
        yield cluster, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_kubernetes_actuator_scales_and_removes_the_drained_pod(fake_cluster: tuple[FakeCluster, str]) -> None:
    cluster, api = fake_cluster
    cluster.add_deployment("kllm-prefill", "kllm-prefill", 2)
    cluster.add_deployment("kllm-decode", "kllm-decode", 1)
    act = KubernetesActuator("ns", {Role.PREFILL: PoolWorkload("kllm-prefill", "app=kllm-prefill", 30000),
                                    Role.DECODE: PoolWorkload("kllm-decode", "app=kllm-decode", 30001)},
                             make_api_client(api))
    assert act.replicas(Role.PREFILL) == 2
    assert act.discover(Role.PREFILL) == ["http://10.0.0.1:30000", "http://10.0.0.2:30000"]
    assert act.add(Role.DECODE) is None
    assert act.replicas(Role.DECODE) == 2
    assert act.discover(Role.DECODE) == ["http://10.0.0.3:30001", "http://10.0.0.4:30001"]
    # remove the *first* prefill pod: the ReplicaSet must delete that one, not an arbitrary one
    act.remove("http://10.0.0.1:30000", Role.PREFILL)
    assert act.replicas(Role.PREFILL) == 1
    assert act.discover(Role.PREFILL) == ["http://10.0.0.2:30000"]
    patches = [c for c in cluster.calls if c[0] == "PATCH"]
    assert any(p[1].endswith("/pods/kllm-prefill-1") for p in patches)
    assert all("patch" in p[2] for p in patches)  # the client sent a PATCH content type


def test_kubernetes_actuator_skips_unready_pods(fake_cluster: tuple[FakeCluster, str]) -> None:
    cluster, api = fake_cluster
    cluster.add_deployment("kllm-decode", "kllm-decode", 2)
    cluster.pods["kllm-decode-2"]["status"]["conditions"][0]["status"] = "False"
    act = KubernetesActuator("ns", {Role.DECODE: PoolWorkload("kllm-decode", "app=kllm-decode", 8000)},
                             make_api_client(api))
    assert act.discover(Role.DECODE) == ["http://10.0.0.1:8000"]


def test_kubernetes_actuator_surfaces_api_errors(fake_cluster: tuple[FakeCluster, str]) -> None:
    from kubernetes.client.exceptions import ApiException

    _, api = fake_cluster
    act = KubernetesActuator("ns", {Role.DECODE: PoolWorkload("missing", "app=missing", 8000)},
                             make_api_client(api))
    with pytest.raises(ApiException):
        act.add(Role.DECODE)


def test_local_process_actuator_starts_and_stops_a_server(tmp_path: Any) -> None:
    act = LocalProcessActuator("unused-model", common_args=["--max-total-tokens", "64"],
                               role_args={Role.PREFILL: ["--disaggregation-mode", "prefill"]},
                               module="kllm_plugins.plugins.bigpd_router.service.fake_backend",
                               log_dir=str(tmp_path), python=sys.executable, stop_grace_s=5)
    try:
        url = act.add(Role.PREFILL)
        act.wait_ready(url, timeout_s=30)
        import urllib.request

        with urllib.request.urlopen(url + "/server_info", timeout=5) as r:
            info = json.loads(r.read())
        assert info["disaggregation_mode"] == "prefill"
        assert info["disaggregation_bootstrap_port"] == act.bootstrap_ports[url]
        proc = act.procs[url]
        act.remove(url)
        assert proc.poll() is not None and url not in act.procs
        with pytest.raises(OSError):
            urllib.request.urlopen(url + "/health", timeout=2)
    finally:
        act.stop_all()


def test_router_discovers_ready_pods_through_the_kubernetes_actuator(
        fake_cluster: tuple[FakeCluster, str]) -> None:
    import asyncio

    from kllm_plugins.plugins.bigpd_router.config import RouterConfig
    from kllm_plugins.plugins.bigpd_router.core.registry import Health
    from kllm_plugins.plugins.bigpd_router.service.router import Router

    cluster, api = fake_cluster
    cluster.add_deployment("kllm-decode", "kllm-decode", 2)
    act = KubernetesActuator("ns", {Role.DECODE: PoolWorkload("kllm-decode", "app=kllm-decode", 30001)},
                             make_api_client(api))
    cfg = RouterConfig(scale_interval_s=0.1, health_interval_s=5, loads_interval_s=0, min_instances=1,
                       max_instances=3)

    async def go() -> None:
        router = Router(cfg, act, (Role.DECODE,))
        await router.start()
        try:
            for _ in range(100):
                if len(router.registry) == 2:
                    break
                await asyncio.sleep(0.05)
            insts = sorted(router.registry, key=lambda i: i.url)
            assert [i.url for i in insts] == ["http://10.0.0.1:30001", "http://10.0.0.2:30001"]
            assert all(i.managed and i.role is Role.DECODE and i.health is Health.STARTING for i in insts)
            assert act.replicas(Role.DECODE) == 2  # two starting members satisfy the minimum: no scaling
        finally:
            await router.stop()

    asyncio.run(asyncio.wait_for(go(), 30))


def test_local_process_actuator_switches_roles_through_the_instance_api() -> None:
    import asyncio

    from aiohttp import web

    from kllm_plugins.plugins.bigpd_router.service.fake_backend import FakeBackend

    fb = FakeBackend(role="decode")

    async def go() -> None:
        runner = web.AppRunner(fb.app())
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
        try:
            act = LocalProcessActuator("unused", role_switch=True)
            assert await asyncio.to_thread(act.switch, url, Role.DECODE, Role.PREFILL)
            assert fb.role == "prefill"
            fb.running = 1  # busy: SGLang refuses, and so does the actuator
            assert not await asyncio.to_thread(act.switch, url, Role.PREFILL, Role.DECODE)
            assert fb.role == "prefill"
            assert not await asyncio.to_thread(LocalProcessActuator("unused").switch, url, Role.PREFILL, Role.DECODE)
            # instances it starts get the flag (and a bootstrap port) only when switching is on
            cmd = act.command(Role.DECODE, 1, 2)
            assert "--enable-pd-role-switch" in cmd
            assert "--enable-pd-role-switch" not in LocalProcessActuator("m").command(Role.DECODE, 1, None)
        finally:
            await runner.cleanup()

    asyncio.run(go())
