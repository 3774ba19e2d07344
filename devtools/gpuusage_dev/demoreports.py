"""The demo's OpenReports: the findings where policy tools (Policy Reporter, Kyverno's UI) read
them, on the pods both demos run."""

from __future__ import annotations

import subprocess
from collections.abc import Callable

from kubernetes import client

from gpuusage.api import names
from gpuusage_dev.demopolicies import wait_until
from gpuusage_dev.localcluster.tools import OPENREPORTS_CRDS, crds

FOUND_IN = ("ml-team", "research")
"""The namespaces whose pods have findings in both demos."""
RESULT = "{.rule}{'\\t'}{.result}/{.severity}{'\\t'}policy={.policy}{'\\n'}"
RESULTS = (
    "jsonpath={range .items[*]}{range .results[*]}{.resources[0].namespace}/"
    f"{{.resources[0].name}}{{'\\t'}}{RESULT}{{end}}{{end}}"
)
NODE_RESULTS = (
    "jsonpath={range .items[*]}{range .results[*]}node/{.resources[0].name}{'\\t'}"
    f"{RESULT}{{end}}{{end}}"
)


def install_openreports(kubectl: list[str]) -> None:
    """The OpenReports CRDs, from the API's Go module (as Kyverno's or Policy Reporter's
    install brings them): the operator publishes its findings once they are served."""
    files = [arg for path in crds(OPENREPORTS_CRDS) for arg in ("-f", str(path))]
    subprocess.run([*kubectl, "apply", "--server-side", *files], check=True, capture_output=True)
    for plural in (names.OPENREPORTS_REPORTS, names.OPENREPORTS_CLUSTER_REPORTS):
        subprocess.run(
            [*kubectl, "wait", "--for=condition=Established", f"crd/{plural}.openreports.io"],
            check=True,
            capture_output=True,
        )


def show_reports(step: Callable[[str], None], kubectl: list[str], api: client.ApiClient) -> None:
    """Wait for the reports of the namespaces with findings, then show them and the nodes'."""
    custom = client.CustomObjectsApi(api)
    group = (names.OPENREPORTS_GROUP, names.OPENREPORTS_VERSION)

    def published() -> bool:
        """The namespaces' reports (the nodes' has results only where a node has findings:
        the simulated node's host process holds memory, the real node has none)."""
        for namespace in FOUND_IN:
            custom.get_namespaced_custom_object(
                *group, namespace, names.OPENREPORTS_REPORTS, names.OPENREPORT_NAME
            )
        return True

    wait_until(published, "the OpenReports")
    step("the findings where policy tools read them: OpenReports (Policy Reporter reads these)")
    for args in (
        ("get", "reports", "-A"),
        ("get", "reports", "-A", "-o", RESULTS),
        ("get", "clusterreports"),
        ("get", "clusterreports", "-o", NODE_RESULTS),
    ):
        print(f"\n$ kubectl {' '.join(args)}", flush=True)
        subprocess.run([*kubectl, *args], check=False)
