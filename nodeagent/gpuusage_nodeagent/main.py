"""`gpuusage agent`: observe, attribute, publish; every --interval until SIGTERM.

The loop never exits on an API error: a failed write is counted and logged, and the next
cycle offers its newer observation, so once the API is back the latest state is published.
It exits for one thing its own process cannot mend: a driver replaced by one of another
version under the NVML library it loaded (gpusource.replaced), with EXIT_DRIVER_REPLACED.
"""

from __future__ import annotations

import gc
import json
import logging
import math
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Literal

from gpuusage.api import names
from gpuusage.api.models import GpuNodeUsageSpec
from gpuusage.errors import GpuusageError
from gpuusage.kube.errors import ApiError
from gpuusage.kube.rest import RestClient
from gpuusage.kube.serverversion import UnsupportedKubernetes, check_server
from gpuusage.settings import comma_list
from gpuusage_nodeagent.activity import ActivityTracker, Key
from gpuusage_nodeagent.caps import capped
from gpuusage_nodeagent.cgroup import Roots, kubelet_roots
from gpuusage_nodeagent.driverfacts import SAMPLE_READ_EVERY
from gpuusage_nodeagent.driverupgrade import CLIENT_DEPLOY_LABEL, PAUSED
from gpuusage_nodeagent.gpusource.base import GpuSource, Reading
from gpuusage_nodeagent.gpusource.fake import FakeSource
from gpuusage_nodeagent.gpusource.null import NullSource
from gpuusage_nodeagent.gpusource.nvml import NvmlSource
from gpuusage_nodeagent.gpusource.releasing import ReleasingSource
from gpuusage_nodeagent.gpusource.replaced import DriverReplaced, LoadedLibrary
from gpuusage_nodeagent.lease import LeaseRenewer
from gpuusage_nodeagent.metrics import AgentMetrics
from gpuusage_nodeagent.ownnode import UpgradeWatch
from gpuusage_nodeagent.podresources.cdi import SpecDirs
from gpuusage_nodeagent.podresources.kubelet import Kubelet
from gpuusage_nodeagent.publisher import WRITE_BACKOFF, Publisher
from gpuusage_nodeagent.report import AttributedReading, reading_pids
from gpuusage_nodeagent.resolver import Resolver
from gpuusage_nodeagent.selfcheck import Setup, gather, nvml_note, pid_namespace_note, with_notes
from gpuusage_nodeagent.settings import AgentSettings
from gpuusage_nodeagent.share import SHARE_READ_SPAN, Share, ShareSchedule, ShareTracker
from gpuusage_nodeagent.visibility import Allowance, with_blind_devices

log = logging.getLogger(__name__)

EXIT_DRIVER_REPLACED = 3
"""The agent's exit status when the driver was replaced under its library (see
gpusource.replaced): the kubelet starts its container again, with the new driver's."""


def make_source(spec: str) -> GpuSource:
    if spec == "nvml":
        return NvmlSource()
    if spec == "none":
        return NullSource("started with --gpu-source none")
    return FakeSource(Path(spec.removeprefix("fake:")))


class NodeReader:
    """Reads the node once per cycle: the GPUs, then each listed pid's container and pod, then
    the kubelet's allocations.

    The kubelet, when asked (see Kubelet), is asked last: a process seen in this cycle belongs
    to a pod the kubelet had admitted (and given its devices) before it was asked, so a pod name
    in its answer never stands for an older pod of the same name than the processes do.
    """

    def __init__(
        self,
        node_name: str,
        source: GpuSource,
        resolver: Resolver,
        *,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
        kubelet: Kubelet | None = None,
        activity: ActivityTracker | None = None,
        share: ShareTracker | None = None,
        allowance: Allowance | None = None,
        setup: Setup | None = None,
    ) -> None:
        self.node_name = node_name
        self.source = source
        self.resolver = resolver
        self.clock = clock
        self.kubelet = kubelet
        self.activity = activity or ActivityTracker()
        self.share = share or ShareTracker()
        self.allowance = allowance or Allowance()
        self.setup = setup
        """How the agent was started (see selfcheck); None: nothing to say about it."""
        self.library = LoadedLibrary()

    def poll(self) -> None:
        """Between two readings: read the GPUs' utilization samplers (see activity)."""
        self.source.poll()

    def sample_shares(self) -> None:
        """Between two readings: the short reads of the samplers of the GPUs several
        processes share, for their shares (see share)."""
        shared = self.share.shared_devices()
        if shared:
            self.source.sample_shares(shared, SHARE_READ_SPAN)

    def read(self) -> AttributedReading:
        """This cycle's reading; DriverReplaced where the driver was replaced by one of another
        version under this process's library (see gpusource.replaced)."""
        raw = self.source.read()
        self.library.check(raw, self.clock())
        reading = capped(with_blind_devices(raw, self.allowance))
        if self.setup is not None and reading.source.kind == "nvml":
            notes = [pid_namespace_note(self.setup)]
            if not reading.source.available:
                notes.append(nvml_note(self.setup, reading.errors))
            reading = replace(reading, source=with_notes(reading.source, notes))
        now = self.clock()
        found = self.resolver.resolve_all(reading_pids(reading))
        self.resolver.end_cycle()
        shares = measure_shares(self.share, reading, now)
        reading, idle = judge_activity(self.activity, reading, now)
        allocated = None
        if self.kubelet is not None:
            pods = {r.attribution.pod_uid for r in found.values() if r.attribution.pod_uid}
            allocated = self.kubelet.read(pods, reading.gpus)
        return AttributedReading(self.node_name, now, reading, found, allocated, idle, shares)


def measure_shares(tracker: ShareTracker, reading: Reading, now: datetime) -> dict[Key, Share]:
    """Each process's compute share where the sampler's reads can vouch for one: of the
    processes whose activity the source tells (not on MIG devices, not MPS clients)."""
    if not tracker.enabled:
        return {}
    meters = {g.uuid: g.utilization.gpu_percent if g.utilization else None for g in reading.gpus}
    shares: dict[Key, Share] = {}
    for uuid, listed in reading.processes.items():
        told = [p.pid for p in listed if p.active is not None]
        if listed and not told and uuid in tracker.devices():
            continue  # its sampler could not be read now: no share this cycle, none forgotten
        reads = reading.share_samples.get(uuid, ())
        found = tracker.device(uuid, told, reads, meters.get(uuid), now)
        shares.update(((uuid, pid), share) for pid, share in found.items() if share is not None)
    tracker.forget_devices_except(reading.processes)
    return shares


def judge_activity(
    tracker: ActivityTracker, reading: Reading, now: datetime
) -> tuple[Reading, dict[Key, datetime]]:
    """The idle processes, since when; and the reading as it is published: a process quiet for
    the window whose idleness the sampler cannot vouch for yet has its activity not known."""
    idle: dict[Key, datetime] = {}
    unsure: dict[str, set[int]] = {}
    for uuid, listed in reading.processes.items():
        told = [(p.pid, p.active) for p in listed]
        verdicts = tracker.device(uuid, told, reading.samples.get(uuid, ()), now)
        for pid, verdict in verdicts.items():
            if verdict.idle_since is not None:
                idle[(uuid, pid)] = verdict.idle_since
            elif verdict.unsure:
                unsure.setdefault(uuid, set()).add(pid)
    tracker.forget_devices_except(reading.processes)
    if not unsure:
        return reading, idle
    processes = dict(reading.processes)
    for uuid, pids in unsure.items():
        processes[uuid] = [p._replace(active=None) if p.pid in pids else p for p in processes[uuid]]
    return replace(reading, processes=processes), idle


def settle_memory() -> None:
    """Move everything alive at start (modules, pydantic's schemas, NVML handles) out of the
    garbage collector's sight.

    The cycle allocates many short-lived objects, which triggers collections; a full
    collection then walked every long-lived object too, which showed as cycles several times
    slower than the median (benchmarks/README.md, agent cycle).
    """
    gc.collect()
    gc.freeze()


def object_for(spec: GpuNodeUsageSpec) -> dict[str, Any]:
    """The GpuNodeUsage object as --output json prints it."""
    return {
        "apiVersion": names.API_VERSION,
        "kind": names.KIND,
        "metadata": {"name": spec.node_name},
        "spec": spec.to_api(),
    }


def _record(metrics: AgentMetrics, attributed: AttributedReading) -> None:
    reading = attributed.reading
    metrics.count_errors(reading.errors)
    metrics.gpus.set(len(reading.gpus))
    metrics.processes.set(sum(map(len, reading.processes.values())))
    metrics.unresolved.set(attributed.unresolved())
    metrics.nvml_available.set(1 if reading.source.available else 0)


def own_kubelet_roots(proc_root: Path) -> Roots:
    """The kubelet's cgroup root as the agent's own cgroup shows it (none outside a pod)."""
    try:
        return kubelet_roots((proc_root / "self" / "cgroup").read_text(errors="replace"))
    except OSError:
        return {}


def run_agent(settings: AgentSettings, stop: threading.Event | None = None) -> int:
    """Run until stop is set (SIGTERM/SIGINT) or after one cycle with --once."""
    stop = stop or threading.Event()
    log.info("agent settings: %s", json.dumps(settings.redacted(), sort_keys=True))
    try:
        source = make_source(settings.gpu_source)
    except GpuusageError as exc:
        log.error("%s", exc)
        return 2
    setup = gather(settings.proc_root)
    if (note := pid_namespace_note(setup)) is not None:
        log.warning("%s", note)
    roots = own_kubelet_roots(settings.proc_root)
    if roots:
        log.info("kubelet cgroup root, from the agent's own cgroup: %s", roots)
    resolver = Resolver(settings.proc_root, grace=settings.attribution_grace, roots=roots)
    kubelet = Kubelet(
        settings.pod_resources_socket,
        settings.pod_resources_timeout,
        comma_list(settings.gpu_resources),
        refresh=settings.pod_resources_refresh,
        cdi=SpecDirs([Path(d) for d in comma_list(settings.cdi_spec_dirs)]),
    )
    reader = NodeReader(
        settings.node_name,
        source,
        resolver,
        kubelet=kubelet,
        activity=ActivityTracker(timedelta(seconds=settings.idle_window)),
        share=ShareTracker(
            timedelta(seconds=settings.share_window), every=settings.share_read_every
        ),
        allowance=Allowance(settings.unexplained_memory_mib, settings.context_memory_mib),
        setup=setup,
    )
    try:
        if settings.output == "json":
            json.dump(object_for(reader.read().spec()), sys.stdout, indent=2)
            sys.stdout.write("\n")
            return 0
        return _loop(settings, reader, stop)
    except DriverReplaced as exc:
        log.error("%s (exit status %d)", exc, EXIT_DRIVER_REPLACED)
        return EXIT_DRIVER_REPLACED
    finally:
        source.close()


def _loop(settings: AgentSettings, reader: NodeReader, stop: threading.Event) -> int:
    metrics = AgentMetrics()
    if settings.metrics_port and not settings.once:
        metrics.serve(settings.metrics_address, settings.metrics_port, settings.interval)
    api, source = RestClient.from_kubeconfig(settings.kubeconfig)
    log.info("API from %s (%s)", source.origin, source.detail)
    try:
        check_server(lambda: api.get("/version"), allow_old=settings.allow_old_kubernetes)
    except UnsupportedKubernetes:
        api.close()
        raise
    release_for_upgrades(settings, reader, api)
    renewer = None
    if settings.lease_namespace and not settings.once:
        renewer = LeaseRenewer(
            api,
            settings.lease_namespace,
            settings.node_name,
            metrics=metrics,
            backoff=WRITE_BACKOFF,
            duration=timedelta(seconds=settings.lease_duration),
        )
        log.info(
            "liveness through Lease %s/%s; an unchanged report is refreshed every %.0fs once "
            "the operator judges the node by it, every %.0fs until then",
            settings.lease_namespace,
            settings.node_name,
            settings.report_refresh,
            settings.heartbeat,
        )
    else:
        log.info(
            "no Lease (no --lease-namespace / POD_NAMESPACE): the report is rewritten every "
            "%.0fs to show the agent alive",
            settings.heartbeat,
        )
    publisher = Publisher(
        api,
        settings.node_name,
        heartbeat=timedelta(seconds=settings.heartbeat),
        threshold_mib=settings.memory_threshold_mib,
        share_threshold=settings.share_threshold,
        metrics=metrics,
        lease_refresh=timedelta(seconds=settings.report_refresh) if renewer else None,
    )
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
    if not settings.once:  # only a long-running loop gains from it
        settle_memory()
    with api:
        failed = run_cycles(settings, reader, publisher, metrics, stop, renewer=renewer)
    log.info("agent stopped")
    return 1 if failed else 0


def release_for_upgrades(settings: AgentSettings, reader: NodeReader, api: RestClient) -> None:
    """Have the reader's source let go of the driver while the GPU Operator's label on the
    agent's Node says it is being replaced (see driverupgrade); not for --gpu-source none,
    which holds no driver, nor with an empty --driver-upgrade-label."""
    if not settings.driver_upgrade_label or settings.gpu_source == "none":
        return
    watch = UpgradeWatch(
        api.get,
        settings.node_name,
        every=timedelta(seconds=settings.driver_upgrade_read_every),
        clock=reader.clock,
        label=settings.driver_upgrade_label,
    )
    kind: Literal["nvml", "fake"] = "nvml" if settings.gpu_source == "nvml" else "fake"
    reader.source = ReleasingSource(reader.source, kind, watch.state)
    log.info(
        "the driver is let go while Node label %s says it is being replaced or %s says %s... "
        "(read every %.0fs)",
        watch.label,
        CLIENT_DEPLOY_LABEL,
        PAUSED,
        settings.driver_upgrade_read_every,
    )


def run_cycles(
    settings: AgentSettings,
    reader: NodeReader,
    publisher: Publisher,
    metrics: AgentMetrics,
    stop: threading.Event,
    *,
    renewer: LeaseRenewer | None = None,
) -> bool:
    """Observe and publish until stopped, renewing the Lease after each completed cycle whose
    report stands published; True when the last write failed."""
    failed = False
    last_failure: str | None = None
    lease_failure: str | None = None
    shares = ShareSchedule(settings.share_read_every) if settings.share_window else None
    while not stop.is_set():
        started = time.monotonic()
        try:
            with metrics.cycle_seconds.time():
                attributed = reader.read()
        except DriverReplaced:
            raise  # only a new process reads the new driver
        except Exception as exc:  # a bug or bad input must not end the node's agent
            metrics.cycle_failures.labels(kind=type(exc).__name__).inc()
            if str(exc) != last_failure:  # a lasting failure once, with its traceback
                last_failure = str(exc)
                log.exception("observing %s failed; the next cycle tries again", settings.node_name)
            failed = True
            if settings.once:
                break
            stop.wait(settings.interval)
            continue
        last_failure = None
        _record(metrics, attributed)
        metrics.cycle_done()
        try:
            publisher.offer(attributed, force=settings.once)
            failed = False
        except ApiError as exc:
            failed = True
            log.error(
                "publishing %s failed: %s (next try in %.0fs)",
                settings.node_name,
                exc,
                settings.interval,
            )
        if renewer is not None and not publisher.current:
            # The Lease vouches for a published report: one whose writes fail (a webhook or a
            # policy refusing them, a schema it does not meet) must turn the node stale
            # rather than keep content of any age Ready.
            withheld = f"the report of {settings.node_name} does not show the latest observation"
            if withheld != lease_failure:
                lease_failure = withheld
                log.error("%s: the Lease is not renewed until it does", withheld)
        elif renewer is not None:
            try:
                renewer.renew_if_due(reader.clock())
                lease_failure = None
            except ApiError as exc:
                if str(exc) != lease_failure:  # a lasting failure once
                    lease_failure = str(exc)
                    log.error("renewing the Lease of %s failed: %s", settings.node_name, exc)
        if settings.once:
            break
        wait_polling(reader, stop, started + settings.interval, shares=shares)
    return failed


def wait_polling(
    reader: NodeReader,
    stop: threading.Event,
    until: float,
    every: float = SAMPLE_READ_EVERY,
    *,
    monotonic: Callable[[], float] = time.monotonic,
    shares: ShareSchedule | None = None,
) -> None:
    """Wait for the next cycle (monotonic time `until`), reading the samplers every `every`
    seconds meanwhile, so that the driver's ring of samples never runs over between two reads
    whatever --interval is; and, on the `shares` schedule (kept across cycles), the short reads
    of the samplers of the GPUs several processes share, for their shares (see share)."""
    start = monotonic()
    next_all = start + every
    while not stop.is_set():
        now = monotonic()
        next_shared = shares.next_at(now) if shares is not None else math.inf
        due = min(next_all, next_shared)
        if until - now <= 0 or stop.wait(max(min(until, due) - now, 0)):
            return
        now = monotonic()
        if until - now <= 0:
            return
        if now < due:
            continue
        try:
            if now >= next_all:
                next_all = now + every
                reader.poll()
            if shares is not None and now >= next_shared:
                shares.read_at(now)
                reader.sample_shares()
        except Exception:  # a bug must not end the node's agent; the cycle reads again
            log.exception("reading the GPUs' samplers failed")
