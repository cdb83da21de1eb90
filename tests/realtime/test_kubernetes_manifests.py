"""deploy/kubernetes: every manifest is valid for the Kubernetes API (its published OpenAPI schemas,
strict: no unknown fields), and what it says of the service holds for the service itself — the
container's arguments parse with our CLI, the probes and the scraped path are our routes, the HPA's
metric is one /metrics exports, the grace period covers the drain."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import kubernetes_validate
import pytest
import yaml
from testing import LiveServer

from realtime.access import KEYS_ENV
from realtime.cli import _config, build_parser

MANIFESTS = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
KUBERNETES_VERSION = "1.33.0"  # a release still supported when these were written


def documents() -> list[tuple[str, dict[str, Any]]]:
    docs: list[tuple[str, dict[str, Any]]] = []
    for path in sorted(MANIFESTS.glob("*.yaml")):
        docs += [(path.name, doc) for doc in yaml.safe_load_all(path.read_text()) if doc]
    return docs


def one(kind: str) -> dict[str, Any]:
    (found,) = [doc for _, doc in documents() if doc["kind"] == kind]
    return found


def _name(value: object) -> str:
    return value if isinstance(value, str) else ""


@pytest.mark.parametrize(("name", "doc"), documents(), ids=_name)
def test_manifest_is_valid_kubernetes(name: str, doc: dict[str, Any]) -> None:
    if doc["kind"] == "Kustomization":  # kustomize's own file, not an API object
        listed = set(doc["resources"])
        assert listed == {path.name for path in MANIFESTS.glob("*.yaml")} - {"kustomization.yaml"}
        return
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def server_container() -> dict[str, Any]:
    (container,) = one("Deployment")["spec"]["template"]["spec"]["containers"]
    return container


def test_the_deployment_runs_our_cli_and_outlasts_its_drain() -> None:
    container = server_container()
    assert container["command"] == ["realtime"]
    config = _config(build_parser().parse_args(container["args"]))
    assert (config.host, config.port) == ("0.0.0.0", container["ports"][0]["containerPort"])
    assert str(config.voice_store) == "/voices"
    keys = {variable["name"]: variable for variable in container["env"]}
    assert keys[KEYS_ENV]["valueFrom"]["secretKeyRef"]["name"]  # the service's keys come from a Secret
    pod = one("Deployment")["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] > config.drain_timeout_s
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    voices = one("Deployment")["spec"]["template"]["spec"]["volumes"]
    claims = {volume["name"]: volume["persistentVolumeClaim"]["claimName"] for volume in voices}
    pvcs = {doc["metadata"]["name"]: doc for _, doc in documents() if doc["kind"] == "PersistentVolumeClaim"}
    assert "ReadWriteMany" in pvcs[claims["voices"]]["spec"]["accessModes"]  # every replica writes voices


def test_selectors_match_the_pods() -> None:
    labels = one("Deployment")["spec"]["template"]["metadata"]["labels"]
    for selector in (one("Service")["spec"]["selector"],
                     one("PodDisruptionBudget")["spec"]["selector"]["matchLabels"],
                     one("Deployment")["spec"]["selector"]["matchLabels"]):
        assert selector.items() <= labels.items()
    target = one("HorizontalPodAutoscaler")["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", one("Deployment")["metadata"]["name"])


@pytest.mark.asyncio(loop_scope="session")
async def test_probes_scrape_path_and_hpa_metric_exist_on_the_service(live_server: LiveServer) -> None:
    container = server_container()
    annotations = one("Deployment")["spec"]["template"]["metadata"]["annotations"]
    probes = ("startupProbe", "readinessProbe", "livenessProbe")
    paths = {container[probe]["httpGet"]["path"] for probe in probes}
    async with httpx.AsyncClient(base_url=live_server.http_url) as client:
        for path in paths | {annotations["prometheus.io/path"]}:
            assert (await client.get(path)).status_code == 200, path
        metrics = (await client.get(annotations["prometheus.io/path"])).text
    (metric,) = one("HorizontalPodAutoscaler")["spec"]["metrics"]
    name = metric["pods"]["metric"]["name"]
    assert any(line.startswith(name + " ") for line in metrics.splitlines()), name
