"""The floor: which clusters gpuusage refuses, how it says so, and that it reads the real
apiserver's version through both of its clients."""

from __future__ import annotations

import json
from typing import Any

import pytest
from kubernetes import client

from gpuusage.kube import raw, serverversion
from gpuusage.kube.core import CoreApi
from gpuusage.kube.rest import RestClient
from gpuusage_dev.localcluster import versions
from gpuusage_dev.localcluster.cluster import LocalCluster


@pytest.mark.parametrize(
    ("answer", "parsed"),
    [
        ({"major": "1", "minor": "37", "gitVersion": "v1.37.2"}, (1, 37)),
        ({"major": "1", "minor": "30+", "gitVersion": "v1.30.4-eks-a737599"}, (1, 30)),
        ({"major": "", "minor": "", "gitVersion": "v1.35.4-gke.1000"}, (1, 35)),
        ({"gitVersion": "v0.0.0-master+$Format:%H$"}, (0, 0)),
        ({}, None),
        ({"major": "one", "minor": "x", "gitVersion": "unknown"}, None),
    ],
)
def test_the_version_is_read_as_managed_services_write_it(
    answer: dict[str, Any], parsed: tuple[int, int] | None
) -> None:
    assert serverversion.parse(answer) == parsed


def test_a_cluster_below_the_floor_is_refused_naming_the_floor_and_why() -> None:
    why = serverversion.refusal(
        {"major": "1", "minor": "34", "gitVersion": "v1.34.4"}, allow_old=False
    )
    assert why is not None
    assert "Kubernetes v1.34.4" in why
    assert f"supports {serverversion.FLOOR_TEXT} and later" in why
    assert "compatibility tests" in why
    assert "--allow-old-kubernetes" in why
    assert serverversion.refusal({"gitVersion": "v1.34.4"}, allow_old=True) is None
    assert serverversion.refusal({"gitVersion": "v1.35.0"}, allow_old=False) is None
    assert serverversion.refusal({"gitVersion": "garbage"}, allow_old=False) is None


def test_the_check_raises_on_refusal_and_lets_an_unanswered_question_pass() -> None:
    with pytest.raises(serverversion.UnsupportedKubernetes, match=r"supports 1\.35 and later"):
        serverversion.check_server(lambda: {"gitVersion": "v1.33.1"}, allow_old=False)

    def away() -> dict[str, Any]:
        raise ConnectionRefusedError("apiserver away")

    serverversion.check_server(away, allow_old=False)  # logged, not raised
    serverversion.check_server(lambda: {"gitVersion": "v1.37.2"}, allow_old=False)


def test_the_floor_is_the_oldest_release_the_local_cluster_runs() -> None:
    """One floor: what the product refuses below is what the compatibility run starts from."""
    assert (1, versions.minor(versions.OLDEST)) == serverversion.FLOOR


@pytest.mark.cluster
def test_both_clients_read_the_real_apiservers_version(
    cluster: LocalCluster, api: client.ApiClient
) -> None:
    expected = (1, versions.minor(cluster.kubernetes_version))
    operator_read = json.loads(raw.body(CoreApi(api).get_code()))
    assert serverversion.parse(operator_read) == expected
    rest, _ = RestClient.from_kubeconfig(cluster.kubeconfig)
    with rest:
        assert serverversion.parse(rest.get("/version")) == expected
    serverversion.check_server(lambda: operator_read, allow_old=False)
