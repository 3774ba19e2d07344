"""The write rule: when a new observation is worth a write, and the fingerprint it compares."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from gpuusage.api.models import Gpu, GpuNodeUsageSpec, MigDevice, Source
from gpuusage_nodeagent.cgroup import CgroupAttribution
from gpuusage_nodeagent.change import Fingerprint, decide, meaningful_change
from gpuusage_nodeagent.gpusource.base import RawProcess, Reading
from gpuusage_nodeagent.report import AttributedReading, reading_pids
from gpuusage_nodeagent.resolver import Resolved
from tests.examples import POD_TRAIN, example_spec

NOW = datetime(2026, 11, 21, 12, 0, tzinfo=UTC)
BEAT = timedelta(seconds=60)


def _with_memory(delta: int, pid_index: int = 0) -> GpuNodeUsageSpec:
    spec = example_spec("n", NOW)
    gpu = spec.gpus[0]
    procs = list(gpu.processes)
    old = procs[pid_index]
    procs[pid_index] = old.model_copy(
        update={"used_memory_mib": (old.used_memory_mib or 0) + delta}
    )
    gpus = [gpu.model_copy(update={"processes": procs}), *spec.gpus[1:]]
    return spec.model_copy(update={"gpus": gpus})


def attributed_from(spec: GpuNodeUsageSpec) -> AttributedReading:
    """The reading and resolver answers that publish `spec` (every other name left to the
    resolver's comm, so both ways of naming a process are covered)."""
    raw: dict[str, list[RawProcess]] = {}
    found: dict[int, Resolved] = {}
    devices: list[Gpu | MigDevice] = [*spec.gpus, *(m for g in spec.gpus for m in g.mig_devices)]
    for device in devices:
        assert device.uuid is not None
        raw[device.uuid] = []
        for i, p in enumerate(device.processes):
            name = None if i % 2 else p.name
            raw[device.uuid].append(
                RawProcess(
                    p.pid,
                    name,
                    p.used_memory_mib,
                    tuple(p.types),
                    p.sm_util_percent,
                    p.memory_util_percent,
                    None if p.activity_unknown else True,
                )
            )
            found[p.pid] = Resolved(CgroupAttribution(p.container_id, p.pod_uid), p.name)
    bare = [
        g.model_copy(
            update={
                "processes": [],
                "mig_devices": [m.model_copy(update={"processes": []}) for m in g.mig_devices],
            }
        )
        for g in spec.gpus
    ]
    source = spec.source or Source(kind="fake", available=True)
    return AttributedReading(
        spec.node_name, spec.observed_at, Reading(source, bare, processes=raw), found
    )


def fingerprint(spec: GpuNodeUsageSpec) -> Fingerprint:
    built = attributed_from(spec)
    assert built.spec().to_api()["gpus"] == spec.to_api()["gpus"], "the reading publishes spec"
    return built.fingerprint()


def test_jitter_below_threshold_is_not_a_change() -> None:
    base = example_spec("n", NOW)
    later = example_spec("n", NOW + timedelta(seconds=10))
    fp = fingerprint(base)
    assert not meaningful_change(fp, fingerprint(later), 64), "observedAt alone is no change"
    assert not meaningful_change(fp, fingerprint(_with_memory(63)), 64)
    assert not meaningful_change(fp, fingerprint(_with_memory(-40)), 64)
    assert meaningful_change(fp, fingerprint(_with_memory(64)), 64)


def test_new_process_or_attribution_is_a_change() -> None:
    base = example_spec("n", NOW)
    gpu = base.gpus[0]
    fewer = base.model_copy(
        update={"gpus": [gpu.model_copy(update={"processes": gpu.processes[1:]}), base.gpus[1]]}
    )
    assert meaningful_change(fingerprint(base), fingerprint(fewer), 64)
    moved = gpu.processes[0].model_copy(update={"pod_uid": None})
    changed = base.model_copy(
        update={
            "gpus": [
                gpu.model_copy(update={"processes": [moved, *gpu.processes[1:]]}),
                base.gpus[1],
            ]
        }
    )
    assert meaningful_change(fingerprint(base), fingerprint(changed), 64)


def test_decide_writes_first_on_change_and_on_heartbeat() -> None:
    base = fingerprint(example_spec("n", NOW))
    assert decide(None, None, base, NOW, heartbeat=BEAT, threshold_mib=64).reason == "first report"
    same = fingerprint(example_spec("n", NOW + timedelta(seconds=30)))
    quiet = decide(base, NOW, same, NOW + timedelta(seconds=30), heartbeat=BEAT, threshold_mib=64)
    assert not quiet.write
    beat = decide(base, NOW, same, NOW + BEAT, heartbeat=BEAT, threshold_mib=64)
    assert (beat.write, beat.reason) == (True, "heartbeat")
    grown = fingerprint(_with_memory(500))
    changed = decide(base, NOW, grown, NOW + timedelta(seconds=1), heartbeat=BEAT, threshold_mib=64)
    assert (changed.write, changed.reason) == (True, "changed")


def test_slow_drift_is_published_once_it_adds_up() -> None:
    """Compared with the last *published* report, 10 steps of 10 MiB do trigger a write."""
    published = fingerprint(example_spec("n", NOW))
    writes = 0
    for step in range(1, 11):
        drifted = fingerprint(_with_memory(10 * step))
        if decide(published, NOW, drifted, NOW, heartbeat=BEAT, threshold_mib=64).write:
            writes += 1
            published = drifted
    assert writes == 1


def test_the_spec_is_built_once_and_the_fingerprint_sees_every_attribution() -> None:
    """The write rule compares a reading's fingerprint and builds the spec only to write it."""
    spec = example_spec("gpu-node-a", NOW)  # GPUs, a MIG device, named and unnamed processes
    attributed = attributed_from(spec)
    reading, found = attributed.reading, dict(attributed.found)
    pids = sorted(reading_pids(reading))
    found[pids[1]] = Resolved(CgroupAttribution(), None, f"pid {pids[1]} exited")
    observed = AttributedReading("gpu-node-a", NOW, reading, found)
    built = observed.spec()
    assert observed.spec() is built, "built once"
    assert observed.unresolved() == 1
    assert [p.resolve_error for g in built.gpus for p in g.processes if p.pid == pids[1]] == [
        f"pid {pids[1]} exited"
    ]
    before = observed.fingerprint()
    assert before != attributed.fingerprint(), "a resolve error is a change"
    for pid, change in (
        (pids[0], Resolved(CgroupAttribution("f" * 64, POD_TRAIN), "trainer")),
        (pids[2], Resolved(CgroupAttribution(None, None), "python3")),
    ):
        moved = AttributedReading("gpu-node-a", NOW, reading, {**found, pid: change})
        assert moved.fingerprint() != before
    later = AttributedReading("gpu-node-a", NOW + timedelta(seconds=9), reading, found)
    assert later.fingerprint() == before, "the time of the reading is no change"
