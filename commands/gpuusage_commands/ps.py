"""`gpuusage ps` (and `kubectl gpuusage ps`): one LIST of GpuNodeUsage objects, then every GPU
process of the chosen nodes, as `nvidia-smi` lists them on one machine.

The rows are built, chosen and rendered by the pure `pstable`. A user the apiserver refuses
the reports sees one namespace's processes from its pods' own marks instead (the pure
`podmarks`)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from gpuusage.errors import GpuusageError
from gpuusage.kube.config import api_client
from gpuusage.settings import CommandSettings
from gpuusage_commands.podmarks import (
    PS_LACKS,
    marks_note,
    nothing_shown,
    order_marked,
    process_rows,
    render_marked,
    render_marked_json,
    show_marked,
)
from gpuusage_commands.pstable import (
    PsSortKey,
    order_processes,
    read_reports,
    render_processes,
    render_processes_json,
)
from gpuusage_commands.reads import ReportsRefused, list_namespace_pods, list_reports, refused
from gpuusage_commands.top import context_namespace
from gpuusage_commands.toptable import select


class PsSettings(CommandSettings):
    namespace: str | None = Field(default=None, json_schema_extra={"short": "-n"})
    """Only processes of pods in this namespace (default: the kubeconfig context's, else
    "default"; with --node, every process of the node)."""
    all_namespaces: bool = Field(default=False, json_schema_extra={"short": "-A"})
    """Every process: of every namespace's pods and of no pod (host processes, the MPS server,
    pids not resolved)."""
    node: str | None = None
    """Only this node's processes."""
    sort: PsSortKey = "memory"
    """Order of the rows (quantities largest first)."""
    output: Literal["table", "wide", "json"] = Field(
        default="table", json_schema_extra={"short": "-o"}
    )
    """Output format (wide: also the device's UUID, the container's ID, the latest SM sample,
    what the share rests on and why a process belongs to no pod)."""
    kubeconfig: Path | None = None
    """Kubeconfig file; else $KUBECONFIG, the in-cluster service account, ~/.kube/config."""
    context: str | None = None
    """The kubeconfig's context to use (default: its current context), as kubectl's."""


def scope(settings: PsSettings) -> str | None:
    """The namespace whose pods' processes are shown; None: every process (-A, or a node
    chosen without -n, whose processes are what one asks of a machine)."""
    if settings.all_namespaces:
        return None
    if settings.namespace:
        return settings.namespace
    if settings.node:
        return None
    return context_namespace(settings.kubeconfig, settings.context)


def _check_namespace(api: Any, namespace: str) -> None:
    """A namespace that does not exist is an error, not an empty list (one that may not be
    read is left to the rows)."""
    from kubernetes import client  # noqa: PLC0415
    from kubernetes.client.exceptions import ApiException  # noqa: PLC0415

    try:
        client.CoreV1Api(api).read_namespace(namespace, _preload_content=False)
    except ApiException as exc:
        if exc.status == 404:
            raise GpuusageError(f"namespace {namespace} not found") from exc


def run_ps(settings: PsSettings) -> int:
    """Print (or emit as JSON) the GPU processes the settings choose, in their order."""
    if settings.all_namespaces and settings.namespace:
        raise GpuusageError("-A and -n cannot go together: -A shows every namespace")
    namespace = scope(settings)
    api, _source = api_client(settings.kubeconfig, context=settings.context)
    with api:
        try:
            items = list_reports(api)
        except ReportsRefused:
            if namespace is None:
                needs = (
                    "-A needs"
                    if settings.all_namespaces
                    else "every process of a node (--node without -n) needs"
                )
                raise refused(
                    needs, "use -n NAMESPACE to see a namespace's processes from its pods' marks"
                ) from None
            return _show_marks(settings, api, namespace)
        if settings.namespace:
            _check_namespace(api, settings.namespace)
    if settings.node and not any(
        (item.get("metadata") or {}).get("name") == settings.node for item in items
    ):
        raise GpuusageError(f"no GpuNodeUsage for node {settings.node}: is it a GPU node?")
    rows, notes, warnings = read_reports(items)
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    chosen = order_processes(select(rows, namespace, settings.node), settings.sort)
    shown = [n for n in notes if settings.node is None or n.node == settings.node]
    if settings.output == "json":
        print(render_processes_json(chosen, shown))
        return 0
    for note in shown:
        print(f"note: {note.text}", file=sys.stderr)
    if not chosen:
        where = f" in namespace {namespace}" if namespace else ""
        on = f" on node {settings.node}" if settings.node else ""
        print(f"No GPU processes{where}{on}.", file=sys.stderr)
        return 0
    print(render_processes(chosen, namespaces=namespace is None, wide=settings.output == "wide"))
    return 0


def _show_marks(settings: PsSettings, api: Any, namespace: str) -> int:
    """One namespace's GPU processes from its pods' own marks, for a user who may not list the
    reports (see podmarks): a line a container and device, with the pids it runs there."""
    pods = list_namespace_pods(api, namespace)
    rows, warnings = process_rows(pods)
    chosen = order_marked(select(rows, namespace, settings.node), settings.sort)
    said = marks_note(namespace, PS_LACKS)
    on = f" on node {settings.node}" if settings.node else ""
    return show_marked(
        settings.output,
        said,
        warnings,
        as_json=lambda: render_marked_json(chosen, said),
        table=(lambda: render_marked(chosen)) if chosen else None,
        empty=nothing_shown(namespace, pods, "No GPU processes", on),
    )
