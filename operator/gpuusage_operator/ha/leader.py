"""High availability: which replica acts. The edge of the election (the rule is `election`'s).

Every replica runs kopf without peering, so every replica's watches stay open; what decides
which one acts is the operator's Lease (`names.LEADER_LEASE` in the operator's namespace),
held as client-go's leader election holds it. A `LeaseElector` thread reads and writes it
every retry period; the `ActiveGate` answers from the election alone, with no "yes" kept
beyond what the renew deadline allows, so a replica that was paused, cut off or refused
stops acting within it, before another may take over. A replica that starts a term forgets
what it remembered of the last (the election replaces its memories: ha.terms), and the elector
then tells `on_term` (the reports are queued to be judged again).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

from kubernetes import client

from gpuusage.api.times import Clock, format_micro_time, parse_time, utc_now
from gpuusage.kube import raw
from gpuusage.kube.core import LeaseApi
from gpuusage.kube.errors import Conflict, NotFound, translate
from gpuusage_operator.ha.election import Election, LeaseRecord

log = logging.getLogger(__name__)

SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def own_identity() -> str:
    """This replica's holderIdentity: the pod name (the hostname in a pod) and the pid, so a
    restarted process is a new holder."""
    return f"{os.environ.get('POD_NAME') or socket.gethostname()}/{os.getpid()}"


def steady() -> float:
    """Seconds that never jump and go on while the machine is suspended (CLOCK_BOOTTIME where
    there is one): a leader woken from a suspended VM must see its deadline past."""
    boottime = getattr(time, "CLOCK_BOOTTIME", None)
    return time.clock_gettime(boottime) if boottime is not None else time.monotonic()


def lease_namespace(configured: str, account_file: Path = SERVICE_ACCOUNT_NAMESPACE) -> str:
    """Where the operator's Lease is: as configured (--leader-elect-resource-namespace, else
    POD_NAMESPACE), else the in-cluster service account's namespace, else `default`."""
    if configured:
        return configured
    try:
        found = account_file.read_text().strip()
    except OSError:
        found = ""
    return found or "default"


def record_of(body: dict[str, Any]) -> LeaseRecord:
    spec = body.get("spec") or {}
    return LeaseRecord(
        holder=str(spec.get("holderIdentity") or ""),
        duration=float(spec.get("leaseDurationSeconds") or 0),
        acquired=parse_time(spec.get("acquireTime")),
        renewed=parse_time(spec.get("renewTime")),
        transitions=int(spec.get("leaseTransitions") or 0),
        version=str((body.get("metadata") or {}).get("resourceVersion") or ""),
    )


def _time(moment: datetime | None) -> str | None:
    return None if moment is None else format_micro_time(moment)


class LeaseLock:
    """The one Lease the replicas share: read, created, replaced on the version read."""

    def __init__(self, api: client.ApiClient, namespace: str, name: str) -> None:
        self._leases = LeaseApi(api)
        self.namespace, self.name = namespace, name

    def __str__(self) -> str:
        return f"Lease {self.namespace}/{self.name}"

    def get(self) -> LeaseRecord | None:
        try:
            response = self._leases.read_namespaced_lease(
                self.name, self.namespace, _preload_content=False
            )
        except Exception as exc:
            if isinstance(translate(exc), NotFound):
                return None
            raise
        return record_of(json.loads(raw.body(response)))

    def write(self, record: LeaseRecord) -> LeaseRecord:
        """Create the Lease (a record of no version) or replace it on `record.version`; what
        was stored. A 409 (someone else wrote first) raises Conflict."""
        spec: dict[str, Any] = {
            "holderIdentity": record.holder or None,
            "leaseDurationSeconds": int(record.duration) if record.duration else None,
            "acquireTime": _time(record.acquired),
            "renewTime": _time(record.renewed),
            "leaseTransitions": record.transitions,
        }
        metadata: dict[str, Any] = {"name": self.name, "namespace": self.namespace}
        if record.version:
            metadata["resourceVersion"] = record.version
        body: Any = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease"}
        body |= {"metadata": metadata, "spec": spec}
        try:
            if record.version:
                response = self._leases.replace_namespaced_lease(
                    self.name, self.namespace, body, _preload_content=False
                )
            else:
                response = self._leases.create_namespaced_lease(
                    self.namespace, body, _preload_content=False
                )
        except Exception as exc:
            raise translate(exc) from exc
        return record_of(json.loads(raw.body(response)))


class Lock(Protocol):
    """What the elector needs of a Lease (LeaseLock; a fake in tests)."""

    def get(self) -> LeaseRecord | None: ...
    def write(self, record: LeaseRecord) -> LeaseRecord: ...


class LeaseElector:
    """The thread that takes and renews the Lease every retry period (sooner when the holder's
    lease runs out sooner), and hands it over when stopped."""

    def __init__(
        self,
        lock: Lock,
        election: Election,
        *,
        clock: Clock = utc_now,
        steady: Callable[[], float] = steady,
    ) -> None:
        self.lock, self.election = lock, election
        self._clock, self._steady = clock, steady
        self._on_change: Callable[[], object] = lambda: None
        self._on_term: Callable[[], object] = lambda: None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing = False

    def start(
        self,
        on_change: Callable[[], object] = lambda: None,
        on_term: Callable[[], object] = lambda: None,
    ) -> None:
        """Start trying in a thread of its own; `on_change` is called after every try (in that
        thread), so that the gate sees a term begin or end without waiting to be asked, and
        `on_term` after a try that began a term."""
        self._on_change, self._on_term = on_change, on_term
        log.info(
            "electing a leader through %s as %s (lease %g s, renew deadline %g s, retry %g s)",
            self.lock,
            self.election.identity,
            self.election.timing.lease_duration,
            self.election.timing.renew_deadline,
            self.election.timing.retry_period,
        )
        self._thread = threading.Thread(target=self._run, name="leader-election", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.try_once()
            try:
                self._on_change()
            except Exception:  # the election must go on
                log.exception("leadership change not handled")
            self._stop.wait(self.election.next_try_in())

    def try_once(self) -> bool:
        """Read the Lease and take or renew it when the rule allows; whether it was written."""
        sent = self._steady()
        try:
            found = self.lock.get()
            wanted = self.election.claim(found, self._clock())
            if wanted is None:
                self._succeeded()
                return False
            written = self.lock.write(wanted)
        except Conflict:
            log.debug("%s was written by another replica first", self.lock)
            self._succeeded()
            return False
        except Exception as exc:
            if not self._failing:
                log.warning("cannot read or write %s: %s", self.lock, translate(exc))
            self._failing = True
            return False
        self._succeeded()
        if self.election.won(sent, written):
            log.info("took %s (transitions %d)", self.lock, written.transitions)
            try:
                self._on_term()
            except Exception:  # the election must go on
                log.exception("new term not handled")
        return True

    def _succeeded(self) -> None:
        if self._failing:
            log.info("%s can be read and written again", self.lock)
        self._failing = False

    def stop(self, release: bool = True) -> None:
        """Stop trying and stop leading at once; with `release`, then hand the Lease over
        (holderIdentity emptied) where this replica holds it, so that another takes over
        within a retry period. Call it once this replica has stopped writing."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        self.election.resign()  # any write still on its way is refused from here (fence)
        if not release:
            return
        try:
            found = self.lock.get()
            handed = None if found is None else self.election.release(found, self._clock())
            if handed is not None:
                self.lock.write(handed)
                log.info("released %s", self.lock)
        except Exception as exc:  # the others take over once the lease runs out
            log.warning("cannot release %s: %s", self.lock, translate(exc))


class ActiveGate:
    """Whether this replica may write now: the election's answer, or always in standalone."""

    def __init__(self, election: Election | None) -> None:
        self._election = election
        self._lock = threading.Lock()
        self._last: bool | None = None

    async def active(self) -> bool:
        """active_now, from the event loop (it reads no API: nothing to wait for)."""
        return self.active_now()

    def active_now(self) -> bool:
        """Whether this replica may write now."""
        answer = self._election is None or self._election.leading()
        if answer != self._last:
            with self._lock:  # said once, whichever thread asks first
                if answer != self._last:
                    log.info("this replica is %s", "active" if answer else "on standby")
                    self._last = answer
        return answer

    @property
    def last(self) -> bool:
        """The latest answer (False before the first); for the `active` metric."""
        return bool(self._last)
