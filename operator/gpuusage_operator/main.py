"""`gpuusage operator`: build the operator's parts from its settings and run kopf until stopped."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Mapping
from datetime import timedelta
from typing import Any, cast

import kopf
from kubernetes import client

from gpuusage.api.times import Clock, utc_now
from gpuusage.kube import raw
from gpuusage.kube.config import api_client
from gpuusage.kube.core import CoreApi, LeaseApi
from gpuusage.kube.serverversion import check_server
from gpuusage_operator.controller.reconcile import Counts, Reconciler
from gpuusage_operator.controller.reportbook import ReportBook
from gpuusage_operator.controller.term import new_terms
from gpuusage_operator.controller.triggers import Triggers
from gpuusage_operator.controller.workqueue import WorkQueue
from gpuusage_operator.ha.election import Election
from gpuusage_operator.ha.leader import (
    LeaseElector,
    LeaseLock,
    lease_namespace,
    own_identity,
    steady,
)
from gpuusage_operator.handlers import build_registry
from gpuusage_operator.informers.apihealth import ApiHealth
from gpuusage_operator.informers.drawatch import DraWatch, resource_apis
from gpuusage_operator.informers.leasewatch import LeaseWatch
from gpuusage_operator.informers.namespacewatch import namespace_informer
from gpuusage_operator.informers.podwatch import PodWatch
from gpuusage_operator.informers.policywatch import PolicyWatch
from gpuusage_operator.informers.reportwatch import ReportWatch
from gpuusage_operator.metrics import OperatorMetrics
from gpuusage_operator.openreports.writer import OpenReportsWriter
from gpuusage_operator.policies.act import Actor
from gpuusage_operator.policies.nodemarks import NodeMarker
from gpuusage_operator.policies.noderun import NodeRunner
from gpuusage_operator.policies.run import PolicyRunner
from gpuusage_operator.settings import OperatorSettings
from gpuusage_operator.writers.budget import WriteBudget
from gpuusage_operator.writers.podmarker import pod_writer

log = logging.getLogger(__name__)


class Operator:
    """The operator's parts (clients, reconciler, pod watch, metrics), built from its settings;
    `run` serves until stopped. Tests and benchmarks read `reconciler.counts`."""

    def __init__(self, settings: OperatorSettings, clock: Clock = utc_now) -> None:
        log.info("operator settings: %s", json.dumps(settings.redacted(), sort_keys=True))
        for warning in settings.deprecated_flags():
            log.warning("%s", warning)
        self.settings, self.clock = settings, clock
        # Every call retries with its own bounded backoff (kube.errors.retried, the pod watch's
        # relist, the next report): urllib3's own retries would only multiply the waits.
        self.api, source = api_client(
            settings.kubeconfig,
            pool_size=settings.workers + 4,
            retries=0,
            request_timeout=settings.api_timeout,
        )
        log.info("API from %s (%s)", source.origin, source.detail)
        self.identity = own_identity()
        self._watch_api, _ = api_client(  # the watch's own
            settings.kubeconfig, retries=0, request_timeout=settings.api_timeout
        )
        self.health = ApiHealth()
        rules = settings.allocation_rules()
        # Built in order, each part complete: the queue and what is remembered of the reports
        # first, then the watches (they only queue names), the writers, the policy runners and
        # the reconciler that uses them all.
        queue, terms, counts = WorkQueue(), new_terms(), Counts()
        idle = settings.watch_idle_timeout

        def book() -> ReportBook:
            return terms.current.book

        triggers = Triggers(queue, book, echoed=lambda: counts.add("echoes_skipped"))
        self.reports = ReportWatch(
            client.CustomObjectsApi(self._watch_api),
            on_event=triggers.report_changed,
            on_listed=triggers.reports_listed,
            health=self.health,
            idle_timeout=idle,
        )
        self.pods = PodWatch(
            CoreApi(self._watch_api),
            health=self.health,
            on_gone=triggers.pod_gone,
            on_requesting=triggers.due,  # reports are named after their nodes
            on_marks=triggers.marks_edited,
            rules=rules,
            idle_timeout=idle,
        )
        self.dra = DraWatch(resource_apis(self._watch_api), health=self.health, idle_timeout=idle)
        self.leases = LeaseWatch(
            LeaseApi(self._watch_api),
            settings.lease_namespace,
            clock=clock,
            health=self.health,
            on_news=triggers.due,
            # the reconciler is built below, before the watch starts
            on_renewed=lambda node: self.reconciler.liveness.renewed(node),  # noqa: PLW0108
            idle_timeout=idle,
        )
        self.namespaces = namespace_informer(
            CoreApi(self._watch_api),
            health=self.health,
            on_change=lambda: triggers.due(book().names()),
            idle_timeout=idle,
        )
        self.policies = PolicyWatch(
            client.CustomObjectsApi(self._watch_api),
            self.namespaces,
            health=self.health,
            on_change=lambda: triggers.due(book().names()),
            idle_timeout=idle,
        )
        marker = pod_writer(
            self.api,
            counts,
            instance=self.identity,
            write_budget=WriteBudget(settings.pod_writes_per_second, settings.pod_write_burst),
            due=triggers.due,
            refresh=self.pods.refresh,
            memory=lambda: terms.current.marks,
            events=lambda: terms.current.events,
        )
        runner = PolicyRunner(
            self.policies,
            client.CustomObjectsApi(self.api),
            marker.annotate,  # the policies write pods through the writer
            marker.record_event,
            notice=timedelta(seconds=settings.policy_notice),
            admit=marker.admit_pod,  # one budget for every pod write
            actor=Actor(self.api, clock) if settings.policy_actions else None,
            clock=clock,
            cluster_actions_per_hour=settings.policy_cluster_actions_per_hour,
        )
        self.reconciler = Reconciler(
            self.api,
            marker,
            counts,
            queue,
            terms,
            rules=rules,
            driver_namespaces=settings.driver_namespace_set(),
            stale_after=(timedelta(seconds=settings.stale_after) if settings.stale_after else None),
            idle_after=timedelta(seconds=settings.idle_after) if settings.idle_after else None,
            restart_grace=timedelta(seconds=settings.restart_grace),
            policies=runner,
            scope=settings.scope(self._namespace_labels),
            nodes=NodeRunner(
                runner,
                marker.record_node_event,
                lambda: terms.current.nodes,
                marker=NodeMarker(self.api) if settings.policy_actions else None,
            ),
            renewals=self.leases.renewal,
        )
        self.openreports = (
            OpenReportsWriter(
                client.CustomObjectsApi(self.api), counts, lambda: terms.current.openreports
            )
            if settings.openreports
            else None
        )
        self._election_api, _ = api_client(  # unfenced: the Lease is written on standby too
            settings.kubeconfig,
            retries=0,
            request_timeout=max(1.0, settings.leader_elect_retry_period),
        )
        self.elector = (
            None
            if settings.standalone
            else LeaseElector(
                LeaseLock(
                    self._election_api,
                    lease_namespace(settings.leader_elect_resource_namespace),
                    settings.leader_elect_resource_name,
                ),
                Election(self.identity, settings.leader_timing(), steady, begin=terms.begin),
                clock=clock,
            )
        )
        self.metrics = OperatorMetrics(self.reconciler, lambda: len(self.pods), self.health)

    def _namespace_labels(self, namespace: str) -> Mapping[str, str] | None:
        facts = self.namespaces.state.namespaces.get(namespace)
        return None if facts is None else facts.labels

    def run(
        self, stop_flag: threading.Event | None = None, ready_flag: threading.Event | None = None
    ) -> int:
        """Serve until SIGTERM/SIGINT (or stop_flag); the clients are closed at the end."""
        settings = self.settings
        try:
            check_server(
                lambda: json.loads(raw.body(CoreApi(self.api).get_code())),
                allow_old=settings.allow_old_kubernetes,
            )
            if settings.metrics_port:
                self.metrics.serve(settings.metrics_address, settings.metrics_port)
            registry = build_registry(
                self.reconciler,
                self.reports,
                self.pods,
                self.metrics,
                kubeconfig=settings.kubeconfig,
                resync_seconds=settings.resync,
                elector=self.elector,
                reconcile_workers=settings.workers,
                health=self.health,
                dra=self.dra,
                leases=self.leases,
                clock=self.clock,
                policies=self.policies,
                namespaces=self.namespaces,
                api_timeout=settings.api_timeout,
                openreports=self.openreports,
            )
            kopf.run(
                registry=registry,
                clusterwide=True,
                standalone=True,  # no kopf peering: the Lease decides who acts (ha.leader)
                identity=cast(Any, self.identity),  # kopf's Identity is a NewType of str
                liveness_endpoint=(
                    f"http://0.0.0.0:{settings.health_port}/healthz"
                    if settings.health_port
                    else None
                ),
                stop_flag=stop_flag,
                ready_flag=ready_flag,
            )
        finally:
            if self.elector is not None:  # released by kopf's cleanup; here, only resigned
                self.elector.stop(release=False)
            self.reports.stop()
            self.pods.stop()
            self.dra.stop()
            self.leases.stop()
            self.policies.stop()
            self.namespaces.stop()
            self._watch_api.close()  # type: ignore[no-untyped-call]
            self._election_api.close()  # type: ignore[no-untyped-call]
            self.api.close()  # type: ignore[no-untyped-call]
        return 0


def run_operator(
    settings: OperatorSettings,
    stop_flag: threading.Event | None = None,
    ready_flag: threading.Event | None = None,
) -> int:
    """Run until SIGTERM/SIGINT (or stop_flag)."""
    return Operator(settings).run(stop_flag, ready_flag)
