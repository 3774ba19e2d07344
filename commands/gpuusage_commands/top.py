"""`gpuusage top` (and `kubectl gpuusage top`): one LIST of GpuNodeUsage objects, then print.

The rows are built, chosen and rendered by the pure `toptable`. A user the apiserver refuses
the reports sees one namespace from its pods' own marks instead (the pure `podmarks`)."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from gpuusage.api.times import format_time
from gpuusage.errors import GpuusageError
from gpuusage.kube import raw
from gpuusage.kube.config import api_client
from gpuusage.settings import CommandSettings
from gpuusage_commands.bill import (
    HEADER,
    RULES,
    Bill,
    bills,
    cells,
    query,
    read_vector,
    statement,
    window_minutes,
)
from gpuusage_commands.podmarks import (
    TOP_LACKS,
    marks_note,
    nothing_shown,
    show_marked,
    top_rows,
)
from gpuusage_commands.promaccess import prometheus_access
from gpuusage_commands.prometheus import NO_ACCESS, Access, base_url, instant_query
from gpuusage_commands.reads import ReportsRefused, list_namespace_pods, list_reports, refused
from gpuusage_commands.toptable import (
    NamespaceRow,
    SortKey,
    allocations_by_node,
    namespace_rows,
    order,
    read_statuses,
    render_json,
    render_namespace_json,
    render_namespace_table,
    render_table,
    rows_of,
    select,
    select_handed,
    with_pending,
)

MAX_NAMESPACE_LISTS = 5
"""Beyond this many namespaces, one LIST of all pods replaces one per namespace."""


class TopSettings(CommandSettings):
    namespace: str | None = Field(default=None, json_schema_extra={"short": "-n"})
    """Only pods of this namespace (default: the kubeconfig context's, else "default")."""
    all_namespaces: bool = Field(default=False, json_schema_extra={"short": "-A"})
    """Pods of every namespace."""
    node: str | None = None
    """Only pods on this node."""
    sort: SortKey = "memory"
    """Order of the rows (quantities largest first)."""
    by: Literal["pod", "namespace"] = "pod"
    """One row a pod, or one a namespace (its pods' GPUs, allocation and memory summed; every
    namespace unless -n names one)."""
    window: str | None = None
    """With --by namespace: also each namespace's bill over this window (e.g. 24h, 7d):
    GPU-hours handed, held, computing, GiB-hours and efficiency, from --prometheus."""
    prometheus: str | None = None
    """Prometheus' base URL (one that evaluates gpuusage's showback rules), for --window."""
    prometheus_token_file: Path | None = None
    """A file holding the bearer token --prometheus asks for (Thanos, Mimir, a managed
    Prometheus)."""
    prometheus_user: str | None = None
    """The basic auth user for --prometheus; its password from --prometheus-password-file."""
    prometheus_password_file: Path | None = None
    """A file holding the basic auth password (never the password itself: a command line is
    visible to every user of the machine)."""
    prometheus_ca_file: Path | None = None
    """The CA bundle (PEM) that --prometheus' certificate is verified with, instead of the
    system's CAs."""
    prometheus_header: tuple[str, ...] = Field(
        default=(), json_schema_extra={"metavar": "'NAME: VALUE'"}
    )
    """A header sent to --prometheus, e.g. 'X-Scope-OrgID: tenant-a' (Mimir's tenant)."""
    output: Literal["table", "json"] = Field(default="table", json_schema_extra={"short": "-o"})
    """Output format."""
    kubeconfig: Path | None = None
    """Kubeconfig file; else $KUBECONFIG, the in-cluster service account, ~/.kube/config."""
    context: str | None = None
    """The kubeconfig's context to use (default: its current context), as kubectl's."""


def context_namespace(kubeconfig: Path | None, context: str | None = None) -> str:
    """The namespace of the context (default: the current one), as kubectl would use it;
    "default" without one."""
    from kubernetes import config  # noqa: PLC0415

    try:
        contexts, current = config.list_kube_config_contexts(  # type: ignore[no-untyped-call]
            config_file=str(kubeconfig) if kubeconfig else None
        )
    except Exception:  # in-cluster, or no kubeconfig: kubectl's default
        return "default"
    if context is not None:
        current = next((c for c in contexts or [] if c.get("name") == context), None)
    return str((current or {}).get("context", {}).get("namespace") or "default")


def _pod_annotations(
    api: Any, namespaces: set[str]
) -> tuple[dict[tuple[str, str], dict[str, str]], str]:
    """The annotations of the pods in these namespaces, by (namespace, name): where a policy's
    pending action is announced. One LIST per namespace (all namespaces at once beyond a few);
    a refusal is a warning, and the column stays empty."""
    from kubernetes import client  # noqa: PLC0415
    from kubernetes.client.exceptions import ApiException  # noqa: PLC0415

    core = client.CoreV1Api(api)
    found: dict[tuple[str, str], dict[str, str]] = {}
    try:
        if len(namespaces) > MAX_NAMESPACE_LISTS:
            answers = [core.list_pod_for_all_namespaces(_preload_content=False)]
        else:
            answers = [
                core.list_namespaced_pod(ns, _preload_content=False) for ns in sorted(namespaces)
            ]
    except ApiException as exc:
        return found, f"pending policy actions not shown: cannot list pods ({exc.status})"
    for answer in answers:
        for item in json.loads(raw.body(answer)).get("items") or []:
            meta = item.get("metadata") or {}
            key = (str(meta.get("namespace")), str(meta.get("name")))
            found[key] = dict(meta.get("annotations") or {})
    return found, ""


def _checked(settings: TopSettings) -> Access:
    """Refuse what cannot work before asking anyone anything; the access to Prometheus, its
    files read."""
    if settings.window is None:
        return NO_ACCESS
    if settings.by != "namespace":
        raise GpuusageError("--window needs --by namespace (the bill is kept per namespace)")
    if not settings.prometheus:
        raise GpuusageError(
            "--window needs --prometheus URL: the hours come from the showback rules "
            "Prometheus evaluates (the reports hold only what is true now)"
        )
    window_minutes(settings.window)
    base_url(settings.prometheus)
    return prometheus_access(
        token_file=settings.prometheus_token_file,
        user=settings.prometheus_user,
        password_file=settings.prometheus_password_file,
        ca_file=settings.prometheus_ca_file,
        headers=settings.prometheus_header,
    )


def read_bills(
    url: str, window: str, namespace: str | None, at: float, access: Access = NO_ACCESS
) -> dict[str, Bill]:
    """Each namespace's bill over the window ending at `at`, one query per column."""
    columns = {
        column: read_vector(instant_query(url, query(column, window, namespace), at, access=access))
        for column in RULES
    }
    return bills(columns)


def run_top(settings: TopSettings) -> int:
    """Print (or emit as JSON) the pods using GPUs, as the settings select and order them."""
    access = _checked(settings)
    api, _source = api_client(settings.kubeconfig, context=settings.context)
    with api:  # one client for the reports and the pods' announcements
        return _show(settings, api, access)


def _show(settings: TopSettings, api: Any, access: Access = NO_ACCESS) -> int:
    try:
        items = list_reports(api)
    except ReportsRefused:
        return _show_marks(settings, api)
    statuses, warnings = read_statuses(items)
    rows = rows_of(statuses)
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    everywhere, node = settings.all_namespaces, settings.node
    if settings.by == "namespace":
        handed = select_handed(allocations_by_node(statuses), settings.namespace, node)
        summed = namespace_rows(select(rows, settings.namespace, node), handed)
        if settings.window and settings.prometheus:
            return _show_bill(settings, summed, settings.window, settings.prometheus, access)
        if settings.output == "json":
            print(render_namespace_json(summed))
        elif summed:
            print(render_namespace_table(summed))
        else:
            print(
                "No pods use or hold GPUs" + (f" on node {node}" if node else "") + ".",
                file=sys.stderr,
            )
        return 0
    namespace = (
        None
        if everywhere
        else settings.namespace or context_namespace(settings.kubeconfig, settings.context)
    )
    chosen = order(select(rows, namespace, node), settings.sort)
    if chosen:
        annotations, problem = _pod_annotations(api, {r.namespace for r in chosen})
        if problem:
            print(f"warning: {problem}", file=sys.stderr)
        with_pending(chosen, annotations)
    if settings.output == "json":
        print(render_json(chosen))
        return 0
    if not chosen:
        where = "any namespace" if everywhere else f"namespace {namespace}"
        print(
            f"No pods use GPUs in {where}" + (f" on node {node}" if node else "") + ".",
            file=sys.stderr,
        )
        return 0
    print(render_table(chosen, everywhere))
    return 0


def _show_marks(settings: TopSettings, api: Any) -> int:
    """One namespace's pods from their own marks, for a user who may not list the reports (see
    podmarks); what needs the reports is refused, naming the right it needs."""
    if settings.by == "namespace":
        raise refused("--by namespace sums", "leave out --by namespace to see one namespace's pods")
    if settings.all_namespaces:
        raise refused("-A needs", "use -n NAMESPACE to see a namespace's pods from their own marks")
    namespace = settings.namespace or context_namespace(settings.kubeconfig, settings.context)
    pods = list_namespace_pods(api, namespace)
    rows, warnings = top_rows(pods)
    chosen = order(select(rows, namespace, settings.node), settings.sort)
    said = marks_note(namespace, TOP_LACKS)
    on = f" on node {settings.node}" if settings.node else ""
    return show_marked(
        settings.output,
        said,
        warnings,
        as_json=lambda: render_json(chosen, said),
        table=(lambda: render_table(chosen, all_namespaces=False)) if chosen else None,
        empty=nothing_shown(namespace, pods, "No pods use GPUs", on),
    )


def _show_bill(
    settings: TopSettings, summed: list[NamespaceRow], window: str, url: str, access: Access
) -> int:
    """The namespaces now, with their bill over the window beside (a namespace billed in the
    window that uses nothing now gets a row too)."""
    at = time.time()
    billed = read_bills(url, window, settings.namespace, at, access)
    now = {r.namespace for r in summed}
    rows = summed + sorted(
        (NamespaceRow(ns) for ns in billed if ns not in now),
        key=lambda r: -billed[r.namespace].handed,
    )
    when = format_time(datetime.fromtimestamp(int(at), UTC))
    if settings.output == "json":
        items = [
            {**asdict(r), "bill": asdict(billed[r.namespace]) if r.namespace in billed else None}
            for r in rows
        ]
        answer = {"window": window, "at": when, "prometheus": url, "items": items}
        print(json.dumps(answer, indent=2))
        return 0
    print(render_namespace_table(rows, (HEADER, {ns: cells(b) for ns, b in billed.items()})))
    print(statement(window, when, url))
    return 0
