"""What `gpuusage top` and `ps` read from the apiserver, and what a refusal of each means.

The reports are cluster-scoped and list every tenant's processes and commands, so many users
may not read them; such a user may still read the pods of their own namespace, whose marks
tell that namespace's use (see podmarks). Which of the two a user gets is the apiserver's
answer to the list itself (403), never a guess.
"""

from __future__ import annotations

import json
from typing import Any, cast

from gpuusage.api import names
from gpuusage.errors import GpuusageError
from gpuusage.kube import raw

VIEWER_ROLE = "gpuusage-viewer"
"""The ClusterRole the install ships for reading every report (manifests/base/viewer)."""
REPORTS = f"{names.PLURAL} (cluster-scoped)"


class ReportsRefused(GpuusageError):
    """The apiserver refuses this user the list of the reports (403)."""


def list_reports(api: Any) -> list[dict[str, Any]]:
    """Every GpuNodeUsage object, in one LIST; a cluster without the API is an error that says
    so, a refusal of the right to list them is ReportsRefused."""
    from kubernetes import client  # noqa: PLC0415
    from kubernetes.client.exceptions import ApiException  # noqa: PLC0415

    try:
        listed = client.CustomObjectsApi(api).list_cluster_custom_object(
            names.GROUP, names.VERSION, names.PLURAL
        )
    except ApiException as exc:
        if exc.status == 404:
            raise GpuusageError(
                "no GpuNodeUsage API on this cluster: is gpuusage installed? "
                "(kubectl apply -k manifests/)"
            ) from exc
        if exc.status == 403:
            raise ReportsRefused(f"cannot list {REPORTS}") from exc
        raise GpuusageError(f"cannot list {names.PLURAL}: {exc.status} {exc.reason}") from exc
    return cast(list[dict[str, Any]], cast(dict[str, Any], listed).get("items") or [])


def refused(needs: str, instead: str) -> GpuusageError:
    """The error for a request only the reports can answer, from a user who may not list them:
    the right it needs, and what the user can do instead."""
    return GpuusageError(
        f"cannot list {REPORTS}, which {needs}: ask for the {VIEWER_ROLE} ClusterRole, or {instead}"
    )


def list_namespace_pods(api: Any, namespace: str) -> list[dict[str, Any]]:
    """The pods of one namespace, as JSON, for a user who may not list the reports: a refusal
    here too names both rights, either of which would answer."""
    from kubernetes import client  # noqa: PLC0415
    from kubernetes.client.exceptions import ApiException  # noqa: PLC0415

    try:
        answer = client.CoreV1Api(api).list_namespaced_pod(namespace, _preload_content=False)
    except ApiException as exc:
        if exc.status == 403:
            raise GpuusageError(
                f"cannot list {REPORTS} nor pods in namespace {namespace}: ask for the "
                f"{VIEWER_ROLE} ClusterRole, or for the right to list pods in {namespace}"
            ) from exc
        raise GpuusageError(
            f"cannot list pods in namespace {namespace}: {exc.status} {exc.reason}"
        ) from exc
    items = json.loads(raw.body(answer)).get("items") or []
    return cast(list[dict[str, Any]], items)
