"""Layer: actuator (no SGLang import). Kubernetes actuator: scales each pool's Deployment.

Uses the official `kubernetes` Python client and only these API calls:
- GET/PATCH  /apis/apps/v1/namespaces/{ns}/deployments/{name}/scale   (the scale subresource)
- GET        /api/v1/namespaces/{ns}/pods?labelSelector=...           (readiness, pod IPs)
- PATCH      /api/v1/namespaces/{ns}/pods/{pod}                       (pod-deletion-cost)
Removing an instance marks its pod with `controller.kubernetes.io/pod-deletion-cost` set low,
so the ReplicaSet deletes that (already drained) pod rather than an arbitrary one when the
replica count goes down. New pods join the router through `discover()` once they are Ready.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Mapping
from urllib.parse import urlsplit

from kllm_plugins.plugins.bigpd_router.core.registry import Role

log = logging.getLogger("kllm.bigpd_router.kubernetes")

DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"


@dataclass(frozen=True)
class PoolWorkload:
    deployment: str
    label_selector: str
    port: int = 30000


def make_api_client(host: str | None = None, token: str | None = None, verify_ssl: bool = True) -> Any:
    """An ApiClient: explicit host (tests, proxies), else in-cluster config, else kubeconfig."""
    from kubernetes import client, config

    if host is not None:
        cfg = client.Configuration()
        cfg.host = host
        cfg.verify_ssl = verify_ssl
        if token:
            cfg.api_key = {"authorization": token}
            cfg.api_key_prefix = {"authorization": "Bearer"}
        return client.ApiClient(cfg)
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.ApiClient()


@dataclass
class KubernetesActuator:
    namespace: str
    pools: Mapping[Role, PoolWorkload]
    api_client: Any = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        from kubernetes import client

        if self.api_client is None:
            self.api_client = make_api_client()
        self._apps = client.AppsV1Api(self.api_client)
        self._core = client.CoreV1Api(self.api_client)

    def replicas(self, role: Role) -> int:
        scale = self._apps.read_namespaced_deployment_scale(self.pools[role].deployment, self.namespace)
        return int(scale.spec.replicas or 0)

    def set_replicas(self, role: Role, n: int) -> None:
        self._apps.patch_namespaced_deployment_scale(
            self.pools[role].deployment, self.namespace, {"spec": {"replicas": int(n)}})
        log.info("scaled deployment=%s replicas=%d", self.pools[role].deployment, n)

    def add(self, role: Role) -> str | None:
        with self._lock:
            self.set_replicas(role, self.replicas(role) + 1)
        return None  # the pod's address is known only once it is scheduled; see discover()

    def remove(self, url: str, role: Role) -> None:
        host = urlsplit(url).hostname
        with self._lock:
            for pod in self._pods(role):
                if pod.status is not None and pod.status.pod_ip == host:
                    self._core.patch_namespaced_pod(
                        pod.metadata.name, self.namespace,
                        {"metadata": {"annotations": {DELETION_COST: "-1000"}}})
                    break
            else:
                log.warning("no pod with ip %s in pool %s; scaling down anyway", host, role.value)
            self.set_replicas(role, max(0, self.replicas(role) - 1))

    def _pods(self, role: Role) -> list[Any]:
        res = self._core.list_namespaced_pod(self.namespace, label_selector=self.pools[role].label_selector)
        return list(res.items or [])

    def discover(self, role: Role) -> list[str]:
        """URLs of the pool's Ready pods (not being deleted)."""
        urls = []
        for pod in self._pods(role):
            st = pod.status
            if st is None or not st.pod_ip or pod.metadata.deletion_timestamp is not None:
                continue
            ready = any(c.type == "Ready" and c.status == "True" for c in (st.conditions or []))
            if ready:
                urls.append(f"http://{st.pod_ip}:{self.pools[role].port}")
        return sorted(urls)
