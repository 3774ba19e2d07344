"""The operator's workers: each takes a report's name from the work queue and reconciles it.

A name comes with the reasons it was queued for (see workqueue, reasons): a report event, a
deadline, a pod event, a Lease renewal, a retry. The worker first drops what the operator kept
of deleted pods, then asks the reconciler whether any reason matters to the report (a renewal
of a fresh report, pod edits that echo our own writes, the deletion of a pod the status does
not list cost no reconcile). It reconciles the report as the report watch's cache holds it now
(the lister, see informers.reportwatch): its latest version, whatever the name was queued for; a
report the cache does not hold is gone, and its pods lose their marks at once. A reconcile
that fails is queued again after a backoff (1 s doubling to 60 s) until it succeeds; one that
succeeds starts its backoff over. Nothing is written unless this replica is the active one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any

from gpuusage.api.times import Clock
from gpuusage.kube.errors import NotLeading
from gpuusage_operator.controller.debounce import Debounce
from gpuusage_operator.controller.reconcile import Reconciler
from gpuusage_operator.controller.triggers import EVENT, STALENESS, gone_pods
from gpuusage_operator.ha.leader import ActiveGate
from gpuusage_operator.informers.drawatch import DraWatch
from gpuusage_operator.informers.podwatch import PodWatch
from gpuusage_operator.metrics import OperatorMetrics

log = logging.getLogger(__name__)
NOT_READY_AGAIN = 0.2
"""Seconds before a name taken while the indexes are not synced yet is tried again."""
STOP_WAIT = 10.0
"""Seconds a stopping operator waits for the reconciles in progress. A write's retries are
bounded (kube.errors.DEFAULT_BACKOFF: 3.7 s of pauses), so a reconcile ends within seconds
unless the API stops answering, which the wait does not outlast."""


ReadReport = Callable[[str], dict[str, Any] | None]
"""A report's name → its latest body from the watch's cache; None: there is none."""


class ReportWorkers:
    """The worker threads."""

    def __init__(
        self,
        reconciler: Reconciler,
        pods: PodWatch,
        dra: DraWatch,
        gate: ActiveGate,
        metrics: OperatorMetrics,
        *,
        read: ReadReport,
        debounce: Debounce,
        clock: Clock,
        ready: Callable[[], bool],
        workers: int,
    ) -> None:
        self.reconciler, self.queue, self._read = reconciler, reconciler.queue, read
        self._pods, self._dra, self._gate, self._metrics = pods, dra, gate, metrics
        self._debounce, self._clock, self._ready = debounce, clock, ready
        self._count = workers
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        for n in range(self._count):
            thread = threading.Thread(target=self._run, name=f"reconcile-{n}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self, wait: float = STOP_WAIT) -> bool:
        """Shut the queue: idle workers return at once, a reconcile in progress finishes
        (waited for at most `wait` seconds in all). Whether every worker has returned: one
        still writing after the operator let go of its clients would write for a replica that
        has stopped."""
        self.queue.shut_down()
        deadline = time.monotonic() + wait
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        busy = [thread.name for thread in self._threads if thread.is_alive()]
        if busy:
            log.warning("stopping with reconciles still in progress on %s", ", ".join(busy))
        return not busy

    def _run(self) -> None:
        while True:
            taken = self.queue.get()
            if taken is None:
                return
            name, reasons = taken
            started = time.monotonic()
            try:
                ran = self.work(name, reasons)
            except NotLeading:  # stopped leading meanwhile: queued again if it leads again
                self.queue.forget(name)
            except Exception as exc:
                delay = self.queue.add_rate_limited(name)
                self._metrics.reconcile_failures.labels(kind=type(exc).__name__).inc()
                log.warning("reconciling report %s failed (%s); again in %.0f s", name, exc, delay)
            else:
                self.queue.forget(name)
                if ran:
                    self._metrics.reconcile_seconds.observe(time.monotonic() - started)
            finally:
                self.queue.done(name)

    def _later(self, name: str, reasons: frozenset[Hashable], delay: float) -> None:
        for reason in reasons or {None}:
            self.queue.add_after(name, delay, reason)

    def work(self, name: str, reasons: frozenset[Hashable]) -> bool:
        """One name's work; whether a reconcile ran. A report is reconciled at most once per
        debounce interval, whatever the reasons: sooner, they wait for the rest of it (its
        latest body too)."""
        reconciler = self.reconciler
        reconciler.forget_pods(gone_pods(reasons))  # on a standby replica too
        if not self._ready():
            self._later(name, reasons, NOT_READY_AGAIN)
            return False
        if not self._gate.active_now():
            return False  # every name is queued again when this replica turns active
        now = self._clock()
        if not reconciler.needs_reconcile(name, reasons, now):
            if STALENESS in reasons:  # renewed meanwhile: the next deadline
                reconciler.liveness.watch(name, now)
            return False
        body = self._read(name)
        if body is None:  # deleted (or never there: a node whose pods carry marks)
            self._debounce.forget(name)
            reconciler.forget_node(name, self._pods.lookup(), now)
            return True
        if reasons == {EVENT} and reconciler.book.is_echo(body):
            # Its status write's echo, come while that reconcile was still finishing (the watch
            # is quicker than the reconcile's last step): told apart now, once it has.
            reconciler.counts.add("echoes_skipped")
            return False
        wait = self._debounce.wait(name, time.monotonic())
        if wait > 0:  # reconciled less than an interval ago (a report rewritten too often)
            if EVENT in reasons:
                self._metrics.reports_held.inc()
            self._later(name, reasons, wait)
            return False
        self._debounce.ran(name, time.monotonic())
        reconciler.reconcile(body, self._pods.lookup(), now, self._dra.lookup())
        return True
