"""Writing the OpenReports: the thin edge under openreports.results.

The writer knows its reports as the apiserver last returned them (listed by our label, then
each write's answer), compares what is wanted with that and writes only a difference: a
Report created when a namespace's first finding comes, replaced (on condition of the version
it knows) when its findings change, deleted when the last one goes. It lists again every
RELIST, and at once after a write that found the report changed or gone, so that a hand edit
or deletion is repaired and nothing it remembers outlives what is stored.

Where the API is not served (the OpenReports CRDs are not installed) or the operator may not
use it, nothing is written and that is said once; it is asked again every UNSERVED_RETRY, and
said once more when it serves.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

from gpuusage.api import names
from gpuusage.kube import raw
from gpuusage.kube.errors import ApiError, Conflict, Forbidden, NotFound, translate
from gpuusage_operator.openreports.results import CONTENT, kept_results, report_content, stamped

log = logging.getLogger(__name__)

RELIST = 300.0
"""Seconds after which the reports are listed again, whatever was written meanwhile."""
UNSERVED_RETRY = 60.0
"""Seconds after which an API that was not served (or refused) is asked again."""
LIST_PAGE = 500
CLUSTER = ""
"""The key of the ClusterReport among the namespaces' Reports."""
API = (names.OPENREPORTS_GROUP, names.OPENREPORTS_VERSION)
LISTING = "/list"
"""The key under which a failure to list is said (once)."""


class ReportCounts(Protocol):
    def add(self, name: str, n: int = 1) -> None:
        """Count `n` more of `name` (safe from any thread)."""


@dataclass(frozen=True)
class Target:
    """Where the report of one key lives: the client's methods for its scope take `where`
    (group, version, [namespace,] plural), then its name."""

    scope: str
    where: tuple[str, ...]
    name: str
    kind: str
    said: str
    """How the log names it."""


def target(key: str) -> Target:
    if key == CLUSTER:
        return Target(
            "cluster",
            (*API, names.OPENREPORTS_CLUSTER_REPORTS),
            names.OPENREPORT_CLUSTER_NAME,
            "ClusterReport",
            "the ClusterReport",
        )
    return Target(
        "namespaced",
        (*API, key, names.OPENREPORTS_REPORTS),
        names.OPENREPORT_NAME,
        "Report",
        f"the Report in {key}",
    )


@dataclass(frozen=True)
class Stored:
    """One of our reports as the apiserver last returned it."""

    version: str
    content: dict[str, Any]


def _stored(body: Mapping[str, Any]) -> Stored:
    meta = body.get("metadata") or {}
    return Stored(str(meta.get("resourceVersion", "")), {k: body.get(k) for k in CONTENT})


@dataclass(slots=True)
class Listing:
    """Our reports as the apiserver last returned them, for one term (controller.term):
    another replica may have written them since this one last led."""

    stored: dict[str, Stored] | None = None
    """Namespace (CLUSTER: the ClusterReport) → our report there; None: to be listed."""
    listed_at: float = 0.0


class OpenReportsWriter:
    """Keeps one Report per namespace with findings and one ClusterReport as `publish` asks."""

    def __init__(
        self,
        custom: Any,
        counts: ReportCounts,
        memory: Callable[[], Listing],
        *,
        monotonic: Callable[[], float] = time.monotonic,
        relist: float = RELIST,
        unserved_retry: float = UNSERVED_RETRY,
    ) -> None:
        self._custom = custom
        self._counts = counts
        self._monotonic = monotonic
        self._relist = relist
        self._unserved_retry = unserved_retry
        self._memory = memory
        """Our reports as last listed or written, the term's (controller.term)."""
        self._unserved: str | None = None
        """Why the API cannot be used, as last said; None: it can."""
        self._asked_at = 0.0
        self.passes = 0
        """Passes that compared the findings with the stored reports (the tests' signal)."""
        self._said: dict[str, str] = {}
        """Report key → the write error last logged for it (each is said once, until a write
        there lands)."""

    @property
    def unserved(self) -> str | None:
        """Why nothing is written (the API not served, or refused); None while it is."""
        return self._unserved

    def publish(
        self,
        namespaces: Mapping[str, list[dict[str, Any]]],
        nodes: list[dict[str, Any]],
        keep: Collection[str] = (),
        *,
        now: datetime,
    ) -> None:
        """Bring the reports in line with these findings: each namespace's pod results (a
        namespace left out has none) and the nodes' results; the nodes in `keep` are not
        judged yet (after a start or a handover), so what the ClusterReport says of them
        stays."""
        memory = self._memory()
        known = self._listing(memory)
        if known is None:
            return
        self.passes += 1
        wanted: dict[str, list[dict[str, Any]]] = {ns: [] for ns in known}
        wanted.update(namespaces)
        for key, listed in known.items():  # pods on nodes not judged yet: as published
            if key != CLUSTER and keep:
                shown = {_uid(r) for r in wanted[key]}
                kept = [r for r in kept_results(listed.content, keep) if _uid(r) not in shown]
                wanted[key] = [*wanted[key], *kept]
        stored_nodes = known.get(CLUSTER)
        kept = kept_results(stored_nodes.content if stored_nodes else {}, keep)
        wanted[CLUSTER] = [*nodes, *kept]
        for key, results in sorted(wanted.items()):
            stored = known.get(key)
            if not results:
                if stored is not None:
                    self._delete(memory, key, stored)
                continue
            previous = (stored.content.get("results") or []) if stored is not None else []
            content = report_content(stamped(results, previous, now))
            if stored is not None and stored.content == content:
                continue
            self._write(memory, key, stored, content)

    # -- the apiserver ---------------------------------------------------------------------
    def _listing(self, memory: Listing) -> dict[str, Stored] | None:
        """Our reports, listed when due; None while the API cannot be used."""
        at = self._monotonic()
        if self._unserved is not None and at - self._asked_at < self._unserved_retry:
            return None
        if memory.stored is not None and at - memory.listed_at < self._relist:
            return memory.stored
        self._asked_at = at
        try:
            found = {
                item["metadata"]["namespace"]: _stored(item)
                for item in self._list(names.OPENREPORTS_REPORTS)
                if item["metadata"].get("name") == names.OPENREPORT_NAME
            }
            for item in self._list(names.OPENREPORTS_CLUSTER_REPORTS):
                if item["metadata"].get("name") == names.OPENREPORT_CLUSTER_NAME:
                    found[CLUSTER] = _stored(item)
        except ApiError as error:
            memory.stored = None
            if isinstance(error, NotFound | Forbidden):
                self._say_unserved(error)
            elif self._said.get(LISTING) != str(error):
                self._said[LISTING] = str(error)
                log.warning("OpenReports not listed (tried again each pass): %s", error)
            return None
        self._said.pop(LISTING, None)
        if self._unserved is not None:
            log.info("OpenReports: %s/%s is served: findings are published", *API)
            self._unserved = None
        memory.stored, memory.listed_at = found, at
        return found

    def _say_unserved(self, error: ApiError) -> None:
        why = "not served" if isinstance(error, NotFound) else "refused"
        if self._unserved != why:
            group, version = API
            log.warning(
                "OpenReports: %s/%s is %s (%s): findings are not published as reports "
                "(install the OpenReports CRDs and the operator's rights on them, or turn this "
                "off with --no-openreports); asked again every %.0f s",
                group,
                version,
                why,
                error,
                self._unserved_retry,
            )
        self._unserved = why

    def _list(self, plural: str) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = []
        token: str | None = None
        while True:
            try:
                response = self._custom.list_cluster_custom_object(
                    *API,
                    plural,
                    label_selector=f"{names.MANAGED_BY_LABEL}={names.MANAGED_BY}",
                    limit=LIST_PAGE,
                    _continue=token,
                    _preload_content=False,
                )
                fields: dict[str, Any] = {}
                items.extend(raw.list_items(raw.body(response), fields))
            except Exception as exc:
                raise translate(exc) from exc
            token = (fields.get("metadata") or {}).get("continue") or None
            if token is None:
                return items

    def _write(
        self, memory: Listing, key: str, stored: Stored | None, content: dict[str, Any]
    ) -> None:
        at = target(key)
        body: dict[str, Any] = {
            "apiVersion": "/".join(API),
            "kind": at.kind,
            "metadata": {
                "name": at.name,
                "labels": {names.MANAGED_BY_LABEL: names.MANAGED_BY},
            },
            **content,
        }
        if key != CLUSTER:
            body["metadata"]["namespace"] = key
        if stored is not None:
            body["metadata"]["resourceVersion"] = stored.version
        try:
            try:
                answer = self._call("replace" if stored is not None else "create", key, body)
            except Conflict:
                taken = self._unlabelled(key) if stored is None else None
                if taken is None:
                    raise
                body["metadata"]["resourceVersion"] = taken  # ours, its label taken off
                answer = self._call("replace", key, body)
        except ApiError as error:
            self._failed(memory, key, error)
            return
        self._counts.add("openreport_writes")
        self._said.pop(key, None)
        if memory.stored is not None:
            memory.stored[key] = _stored(raw.written_object(answer) or body)

    def _unlabelled(self, key: str) -> str | None:
        """The resourceVersion of the report under our name that our label-selected list did
        not show (a person took the label off): written whole again, label and all. None:
        there is none (it was created meanwhile: listed again)."""
        at = target(key)
        method = getattr(self._custom, f"list_{at.scope}_custom_object")
        try:
            response = method(
                *at.where, field_selector=f"metadata.name={at.name}", _preload_content=False
            )
            found = list(raw.list_items(raw.body(response), {}))
        except Exception:  # listed again from scratch instead
            return None
        meta = (found[0].get("metadata") or {}) if found else {}
        if not found or (meta.get("labels") or {}).get(names.MANAGED_BY_LABEL) == names.MANAGED_BY:
            return None
        return str(meta.get("resourceVersion", "")) or None

    def _delete(self, memory: Listing, key: str, stored: Stored) -> None:
        options = {"preconditions": {"resourceVersion": stored.version}}
        try:
            self._call("delete", key, options)
        except NotFound:
            pass  # gone already (its namespace deleted, a person)
        except ApiError as error:
            self._failed(memory, key, error)
            return
        else:
            self._counts.add("openreport_writes")
        self._said.pop(key, None)
        if memory.stored is not None:
            memory.stored.pop(key, None)

    def _failed(self, memory: Listing, key: str, error: ApiError) -> None:
        """A write that did not land: listed again before the next try where what is stored
        is not what was known (changed, deleted or created meanwhile); each kind of failure is
        said once per report."""
        self._counts.add("openreport_errors")
        if isinstance(error, Conflict | NotFound):
            memory.stored = None
        said = f"{type(error).__name__}: {error.reason}"
        if self._said.get(key) == said:
            return
        self._said[key] = said
        where = target(key).said
        log.warning("OpenReports: %s not written (tried again next pass): %s", where, error)

    def _call(self, verb: str, key: str, body: dict[str, Any]) -> bytes:
        at = target(key)
        method = getattr(self._custom, f"{verb}_{at.scope}_custom_object")
        try:
            if verb == "create":
                answer = method(*at.where, body, _preload_content=False)
            elif verb == "replace":
                answer = method(*at.where, at.name, body, _preload_content=False)
            else:
                answer = method(*at.where, at.name, body=body, _preload_content=False)
            return raw.body(answer)
        except Exception as exc:
            raise translate(exc) from exc


def _uid(result: Mapping[str, Any]) -> object:
    resources = result.get("resources") or [{}]
    first = resources[0] if isinstance(resources[0], dict) else {}
    return first.get("uid")
