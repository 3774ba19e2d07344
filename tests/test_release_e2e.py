"""The release end to end, as a platform team meets it: `make release`'s code publishes to a
real registry (the CNCF Distribution registry on loopback), and on the real node (kubelet,
containerd, runc) the release's parent commit is installed from its chart, then upgraded with
`helm upgrade` to the release's chart from `oci://` — whose images the node's containerd pulls
by digest from that registry, nothing imported. The upgrade serves the release's CRDs, loses no
mark on a pod and announces no finding twice; the findings keep coming. Then, uninstalled, the
release is installed afresh with `helm install` from oci://, and flags a pod.

The short form (CI, `make test`) builds for this machine's platform; `make test-release` builds
every release platform. Skipped, with the reason, where the machine cannot run a node."""

from __future__ import annotations

import json
import os
import subprocess
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client, watch

from gpuusage import __version__
from gpuusage.api import names
from gpuusage.kube.config import api_client
from gpuusage_dev.localcluster.node import (
    DEFAULT_SCENARIO,
    cannot_run_node,
    running_node,
    write_scenario,
)
from gpuusage_dev.localcluster.platforms import HOST
from gpuusage_dev.localcluster.productimages import REPO, git_output
from gpuusage_dev.localcluster.tools import CRANE, HELM, ensure_tool
from gpuusage_dev.localcluster.workloads import sleeper_deployment
from gpuusage_dev.release import chart
from gpuusage_dev.release.images import build, short_name
from gpuusage_dev.release.make import Release, release
from gpuusage_dev.release.publish import push
from gpuusage_dev.release.registry import LocalRegistry, running_registry
from gpuusage_dev.simulation import ensure_namespace
from gpuusage_nodeagent.podresources.kubelet import list_pods
from gpuusage_nodeagent.podresources.wire import list_response
from tests.conftest import Helm, release_test_platforms, wait_for
from tests.nodeworld import (
    NAME,
    NodeWorld,
    chart_values,
    event_reasons,
    gpu_condition,
    host_pid,
    running_pod,
    wait_for_event,
)

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.node]

NS = "gpuusage-system"


@dataclass(frozen=True)
class Upgrade:
    """The release published, its parent's images pushed beside it, the node."""

    registry: LocalRegistry
    made: Release
    parent: Path
    """A clone of the repository at the release's parent commit."""
    parent_images: dict[str, str]
    released_images: dict[str, str]
    """Component (agent, operator) → the release's image by digest in the registry."""
    """Component (agent, operator) → the parent's image by digest in the registry."""
    world: NodeWorld
    helm: Helm


def _parent(work: Path) -> Path:
    """The commit the release upgrades from, cloned (its chart and its images' sources): the
    release's parent, or $GPUUSAGE_UPGRADE_FROM (a commit from before a change of the install,
    such as e5ce198, whose chart still kept the CRDs in crds/)."""
    wanted = os.environ.get("GPUUSAGE_UPGRADE_FROM", "HEAD~1")
    parent = git_output(REPO, "rev-parse", "--verify", "--quiet", f"{wanted}^{{commit}}")
    assert parent, f"no commit {wanted} in the checkout (a shallow clone: fetch-depth 2 or more)"
    folder = work / "parent"
    subprocess.run(["git", "clone", "-q", "--shared", str(REPO), str(folder)], check=True)
    subprocess.run(["git", "-C", str(folder), "checkout", "-q", "--detach", parent], check=True)
    return folder


@pytest.fixture(scope="module")
def upgrade(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Upgrade]:
    why = cannot_run_node(product=True)
    if why is not None:
        pytest.skip(f"this machine cannot run a node: {why}")
    work = tmp_path_factory.mktemp("release-e2e")
    parent_clone = _parent(work)
    with running_registry(work / "registry") as registry:
        where = f"{registry.host}/gpuusage"
        made = release(
            REPO, work / "dist", where, platforms=release_test_platforms(), command="pytest"
        )
        old = build(work / "parent-dist", repo=parent_clone, platforms=(HOST,), command="pytest")
        crane = ensure_tool(CRANE)
        parent = {one.name: push(crane, one, f"{registry.host}/parent", __version__) for one in old}
        scenario = work / "scenario"
        scenario.mkdir()
        write_scenario(scenario, {}, DEFAULT_SCENARIO)
        with running_node(work, NAME, scenario=DEFAULT_SCENARIO) as (cluster, node):
            api, _ = api_client(cluster.kubeconfig)
            world = NodeWorld(scenario, cluster, node, api, client.CoreV1Api(api), work)
            helm = Helm(ensure_tool(HELM), work / "helm", cluster.kubeconfig)
            yield Upgrade(
                registry, made, parent_clone, by_component(parent),
                by_component(made.published), world, helm,
            )  # fmt: skip


def by_component(references: Mapping[str, str]) -> dict[str, str]:
    """Image name (and "chart") → reference, as the chart's component (agent, operator) →
    its image's reference."""
    return {
        chart.COMPONENTS[short_name(name)]: reference
        for name, reference in references.items()
        if name != "chart"
    }


def _values(up: Upgrade, path: Path, images: dict[str, str] | None = None) -> Path:
    """The local node's values, and, for the parent (whose chart pins nothing), its images."""
    values = chart_values(up.world.cluster, up.world.node, up.world.scenario)
    for component, reference in (images or {}).items():
        named, digest = reference.split("@", 1)
        registry, repository = named.split("/", 1)
        values[component]["image"] = {
            "registry": registry,
            "repository": repository,
            "digest": digest,
        }
    path.write_text(yaml.safe_dump(values))
    return path


def _running_images(world: NodeWorld) -> dict[str, str]:
    """Component → the image its running pods' containers run, by digest, as the kubelet
    reports it (the index's digest where it was pulled by that)."""
    pods = world.core.list_namespaced_pod(NS).items
    out: dict[str, set[str]] = {}
    for pod in pods:
        if pod.metadata.deletion_timestamp or pod.status.phase != "Running":
            continue
        component = chart.COMPONENTS[pod.metadata.labels["app.kubernetes.io/name"]]
        out.setdefault(component, set()).add(pod.spec.containers[0].image)
    return {c: next(iter(images)) for c, images in out.items() if len(images) == 1}


def _marks(world: NodeWorld, namespace: str, pod: str) -> tuple[str | None, str | None]:
    """The pod's GPU annotation and its GPUInUse condition's reason."""
    found = world.core.read_namespaced_pod(pod, namespace)
    condition = gpu_condition(world, namespace, pod)
    annotation = (found.metadata.annotations or {}).get(names.ANNOTATION_GPUS)
    return annotation, (condition or {}).get("reason")


def _watch_marks(
    world: NodeWorld,
    expected: dict[tuple[str, str], set[tuple[str | None, str | None]]],
    lost: list[tuple[str, tuple[str | None, str | None]]],
    devices: set[str],
    done: threading.Event,
) -> None:
    """Until `done`: every version of the `expected` pods the apiserver sends, its marks
    compared with what they may be (into `lost` where not); the device annotations seen."""
    selector = "app in (train,sneaky)"
    listed = world.core.list_pod_for_all_namespaces(label_selector=selector)
    version = listed.metadata.resource_version
    stream = watch.Watch()  # type: ignore[no-untyped-call]
    while not done.is_set():
        for event in stream.stream(  # type: ignore[no-untyped-call]
            world.core.list_pod_for_all_namespaces,
            label_selector=selector,
            resource_version=version,
            timeout_seconds=2,
        ):
            pod = event["object"]
            version = pod.metadata.resource_version
            annotations = pod.metadata.annotations or {}
            reasons = [
                c.reason
                for c in (pod.status.conditions or [])
                if c.type == names.POD_CONDITION_GPU_IN_USE
            ]
            seen = (annotations.get(names.ANNOTATION_GPUS), reasons[0] if reasons else None)
            if seen not in expected.get((pod.metadata.namespace, pod.metadata.name), {seen}):
                lost.append((pod.metadata.name, seen))
            devices.add(str(annotations.get(names.ANNOTATION_GPUS)))
            if done.is_set():
                break


def _account(world: NodeWorld, namespace: str) -> None:
    wait_for(lambda: world.core.read_namespaced_service_account("default", namespace), what="SA")


def _wait_marked(
    world: NodeWorld, namespace: str, pod: str, marks: tuple[str | None, str | None]
) -> None:
    wait_for(lambda: _marks(world, namespace, pod) == marks, timeout=120, what=f"{pod} marked")


def _properties(schema: dict[str, Any], prefix: str = "") -> set[str]:
    """Every property path of an OpenAPI schema."""
    out: set[str] = set()
    for name, sub in (schema.get("properties") or {}).items():
        out |= {f"{prefix}{name}", *_properties(sub, f"{prefix}{name}.")}
    if "items" in schema:
        out |= _properties(schema["items"], f"{prefix}[].")
    return out


def test_the_release_upgrades_its_parent_and_keeps_every_mark(upgrade: Upgrade) -> None:
    up, world = upgrade, upgrade.world
    images = world.node.containerd.ctr("images", "list", "-q").stdout.decode()
    assert "gpuusage-agent" not in images, "nothing of the product is imported into the node"

    # The parent commit's chart, its images from the registry.
    parent_values = _values(up, up.parent / "values.local.yaml", up.parent_images)
    up.helm.run(
        "install", "gpuusage", str(up.parent / "charts" / "gpuusage"), "-n", NS,
        "--create-namespace", "-f", str(parent_values), "--wait", "--timeout", "240s",
    )  # fmt: skip
    assert _running_images(world) == up.parent_images

    # The demo's findings, from the parent: a pod in use on its GPU, one using a GPU unasked.
    ensure_namespace(world.core, "ml")
    ensure_namespace(world.core, "lab")
    apps = client.AppsV1Api(world.api)
    for namespace, app, gpus in (("ml", "train", 1), ("lab", "sneaky", 0)):
        _account(world, namespace)
        deployment: Any = sleeper_deployment(app, namespace, gpus)
        apps.create_namespaced_deployment(namespace, deployment)
    train = wait_for(lambda: running_pod(world, "ml", "train"), timeout=90, what="train")
    sneaky = wait_for(lambda: running_pod(world, "lab", "sneaky"), timeout=90, what="sneaky")
    socket = world.node.directory / "kubelet" / "pod-resources" / "kubelet.sock"
    given = {p.name: p for p in list_response(list_pods(socket, 5))}[train.metadata.name]
    (device,) = given.containers[0].devices[0].device_ids
    other = next(g["uuid"] for g in DEFAULT_SCENARIO["gpus"] if g["uuid"] != device)

    def pid(pod: Any) -> int:
        return host_pid(world, pod.status.container_statuses[0].container_id.split("://")[1])

    def scenario(*, both: bool) -> None:
        """The train pod's process on `device`, and (`both`) on the other device too."""
        trained = [{"pid": pid(train), "usedMemoryMiB": 1024}]
        write_scenario(
            world.scenario,
            {
                device: trained,
                other: [{"pid": pid(sneaky), "usedMemoryMiB": 512}, *(trained if both else [])],
            },
        )

    scenario(both=False)
    marked = {
        ("ml", train.metadata.name): (device, "ProcessesRunning"),
        ("lab", sneaky.metadata.name): (other, "UsingUnrequestedGPU"),
    }
    for (namespace, pod), marks in marked.items():
        _wait_marked(world, namespace, pod, marks)
    wait_for_event(world, "ml", train.metadata.name, "GPUUseStarted")
    wait_for_event(world, "lab", sneaky.metadata.name, "UsingUnrequestedGPU")

    # helm upgrade to the release's chart from the registry, while a pod watch checks the
    # marks on every change of the two pods.
    lost: list[tuple[str, tuple[str | None, str | None]]] = []
    seen: set[str] = set()
    done = threading.Event()
    both = ",".join(sorted((device, other)))  # the change below: a device more, in use at once
    expected = {key: {marks} for key, marks in marked.items()}
    expected["ml", train.metadata.name] |= {
        (both, "ProcessesRunning"),
        (both, "UsingUnallocatedGPU"),  # (where its allocation names its device)
    }
    watcher = threading.Thread(
        target=_watch_marks, args=(world, expected, lost, seen, done), daemon=True
    )
    watcher.start()
    try:
        released_values = _values(up, up.parent / "values.release.yaml")
        # A chart from before 0.1.0 installed the CRDs from its crds/, owned by no release: the
        # upgrade adopts them (CHANGELOG, 0.1.0's Upgrading).
        adopt = ("--take-ownership",) if (up.parent / "charts/gpuusage/crds").is_dir() else ()
        out = up.helm.run(
            "upgrade", "gpuusage", f"oci://{up.registry.host}/gpuusage/charts/gpuusage",
            "--version", __version__, "--plain-http", "-n", NS, "-f", str(released_values),
            "--wait", "--timeout", "240s", *adopt,
        )  # fmt: skip
        assert "has been upgraded" in out.stdout + out.stderr
        published = up.released_images
        wait_for(lambda: _running_images(world) == published, timeout=120, what="the release")
        # The release's operator acts: a change in use (a second device) reaches the pod.
        scenario(both=True)

        def shown() -> bool:
            found = world.core.read_namespaced_pod(train.metadata.name, "ml")
            return (found.metadata.annotations or {}).get(names.ANNOTATION_GPUS) == both

        wait_for(shown, timeout=120, what="the release's operator marking a change")
    finally:
        done.set()
        watcher.join()
    assert lost == [], "a pod's mark went missing or changed during the upgrade"
    assert both in seen, "the watch heard the pods change"

    # Pulled by digest from the registry by the node's containerd: nothing was imported.
    held = world.node.containerd.ctr("images", "list", "-q").stdout.decode().split()
    assert set(published.values()) <= set(held), held

    # No finding announced twice across the change of operator.
    assert event_reasons(world, "ml", train.metadata.name).count("GPUUseStarted") == 1
    assert event_reasons(world, "lab", sneaky.metadata.name).count("UsingUnrequestedGPU") == 1

    # The release's CRDs are served: every field of its schema.
    for path in sorted((REPO / "crds").glob("gpuusage.io_*.yaml")):
        crd = yaml.safe_load(path.read_text())
        raw: Any = client.ApiextensionsV1Api(world.api).read_custom_resource_definition(
            crd["metadata"]["name"], _preload_content=False
        )
        served = json.loads(raw.data)
        for version, wanted in zip(
            served["spec"]["versions"], crd["spec"]["versions"], strict=True
        ):
            have = _properties(version["schema"]["openAPIV3Schema"])
            assert _properties(wanted["schema"]["openAPIV3Schema"]) <= have, path.name
        assert served["metadata"]["annotations"]["meta.helm.sh/release-name"] == "gpuusage"


def test_a_fresh_install_from_the_registry_flags_a_pod(upgrade: Upgrade) -> None:
    """`helm install` of the release's chart from oci://, where no release is (the one before
    uninstalled: the CRDs and the reports stay): its components run the pinned images from the
    registry, and a pod using a GPU it did not ask for is flagged, with its Event."""
    up, world = upgrade, upgrade.world
    up.helm.run("uninstall", "gpuusage", "-n", NS, "--wait", "--timeout", "180s", check=False)
    wait_for(lambda: not _running_images(world), timeout=120, what="the components gone")
    values = _values(up, up.parent / "values.fresh.yaml")
    up.helm.run(
        "install", "gpuusage", f"oci://{up.registry.host}/gpuusage/charts/gpuusage",
        "--version", __version__, "--plain-http", "-n", NS, "-f", str(values),
        "--wait", "--timeout", "240s",
    )  # fmt: skip
    published = up.released_images
    wait_for(lambda: _running_images(world) == published, timeout=120, what="the release")
    apps = client.AppsV1Api(world.api)
    _account(world, "lab")
    deployment: Any = sleeper_deployment("stray", "lab", 0)
    apps.create_namespaced_deployment("lab", deployment)
    stray = wait_for(lambda: running_pod(world, "lab", "stray"), timeout=90, what="stray")
    cid = stray.status.container_statuses[0].container_id.split("://")[1]
    gpu = DEFAULT_SCENARIO["gpus"][0]["uuid"]
    write_scenario(world.scenario, {gpu: [{"pid": host_pid(world, cid), "usedMemoryMiB": 512}]})
    _wait_marked(world, "lab", stray.metadata.name, (gpu, "UsingUnrequestedGPU"))
    wait_for_event(world, "lab", stray.metadata.name, "UsingUnrequestedGPU")
