"""The DRA driver's Python side, without the driver: a GPU scenario → what it publishes and
prepares (driver_config), NVIDIA's names, the wrapper's paths and status, and the kubelet's
calls encoded by hand. The driver itself runs in test_draplugin_on_cluster."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from gpuusage.api.models import MIG_UUID_PATTERN
from gpuusage_dev.draplugin import (
    CDI_KIND,
    DRIVER,
    PLUGINS_DIR,
    REGISTRAR_DIR,
    DraPlugin,
    cdi_spec_path,
    device_classes,
    driver_config,
    dynamic_mig_uuid,
    kubeletcalls,
)
from gpuusage_dev.draplugin.kubeletcalls import Claim
from gpuusage_dev.localcluster.node import DEFAULT_SCENARIO
from gpuusage_nodeagent.podresources.wire import fields, message_field

A100_80 = "NVIDIA A100-SXM4-80GB"
A100_40 = "NVIDIA A100-SXM4-40GB"


def _gpu(index: int, name: str = A100_80, mib: int = 81920, **more: Any) -> dict[str, Any]:
    return {
        "index": index,
        "uuid": f"GPU-{index:08d}-0000-4000-8000-000000000000",
        "name": name,
        "memoryTotalMiB": mib,
        **more,
    }


def _mig(index: int, profile: str | None, parent: str = A100_80) -> dict[str, Any]:
    name = f"{parent} MIG {profile}" if profile else parent
    return {"index": index, "uuid": f"MIG-{index:08d}-0000-4000-8000-000000000000", "name": name}


def _devices(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {d["name"]: d for s in config["slices"] for d in s.get("devices", [])}


def _attrs(device: dict[str, Any]) -> dict[str, str]:
    return {k: next(iter(v.values())) for k, v in device["attributes"].items()}


def test_whole_gpus_are_one_slice_of_gpu_devices() -> None:
    """The node's default scenario: four whole GPUs, each `gpu-<index>` with NVIDIA's
    attributes and its memory as capacity, in one slice of the pool named after the node."""
    config = driver_config(DEFAULT_SCENARIO, "node-a")
    assert (config["driverName"], config["pool"]) == (DRIVER, "node-a")
    assert len(config["slices"]) == 1
    devices = _devices(config)
    assert list(devices) == ["gpu-0", "gpu-1", "gpu-2", "gpu-3"]
    first = DEFAULT_SCENARIO["gpus"][0]
    assert _attrs(devices["gpu-0"]) == {
        "type": "gpu",
        "uuid": first["uuid"],
        "productName": "NVIDIA H100 80GB HBM3",
        "driverVersion": "550.54.15",
        "cudaDriverVersion": "12.4.0",
    }
    assert devices["gpu-0"]["attributes"]["driverVersion"] == {"version": "550.54.15"}
    assert devices["gpu-0"]["capacity"] == {"memory": {"value": "81559Mi"}}
    assert config["devices"]["gpu-0"] == {"uuid": first["uuid"], "parent": "gpu-0"}


def test_a_gpu_is_named_after_its_minor_number_when_the_scenario_gives_one() -> None:
    config = driver_config({"gpus": [_gpu(0, minorNumber=4)]}, "n")
    assert list(_devices(config)) == ["gpu-4"]


def test_a_gpu_that_fails_is_left_out() -> None:
    config = driver_config({"gpus": [_gpu(0), _gpu(1, error="GpuIsLost")]}, "n")
    assert list(_devices(config)) == ["gpu-0"]


def test_mig_devices_made_beforehand_are_named_by_profile_and_placement() -> None:
    """Placed in the scenario's order, each at the first start its size allows (a 3g takes
    four memory slices and starts at 0 or 4); profile IDs as NVML has them; a MIG device whose
    name carries no profile is left out, as the device plugin leaves it out."""
    migs = [_mig(0, "1g.10gb"), _mig(1, "1g.10gb+me"), _mig(2, "2g.20gb"), _mig(3, "3g.40gb")]
    migs.append(_mig(4, None))
    config = driver_config({"gpus": [_gpu(0, migDevices=migs)]}, "n")
    devices = _devices(config)
    assert list(devices) == [
        "gpu-0-mig-1g10gb-19-0",
        "gpu-0-mig-1g10gb-me-20-1",
        "gpu-0-mig-2g20gb-14-2",
        "gpu-0-mig-3g40gb-9-4",
    ]
    assert _attrs(devices["gpu-0-mig-3g40gb-9-4"]) == {
        "type": "mig",
        "uuid": migs[3]["uuid"],
        "parentUUID": _gpu(0)["uuid"],
        "profile": "3g.40gb",
        "productName": A100_80,
        "driverVersion": "550.54.15",
        "cudaDriverVersion": "12.4.0",
    }
    assert config["devices"]["gpu-0-mig-3g40gb-9-4"] == {"uuid": migs[3]["uuid"], "parent": "gpu-0"}


def test_mig_profiles_are_read_against_the_gpus_memory() -> None:
    """A 1g.10gb is one memory slice of an 80 GB GPU and a 1g.10gb of a 40 GB one is two
    (NVML's profile 15), as each card has it."""
    small = driver_config({"gpus": [_gpu(0, A100_40, 40960, migDevices=[_mig(0, "1g.10gb")])]}, "n")
    assert list(_devices(small)) == ["gpu-0-mig-1g10gb-15-0"]


def test_an_unknown_mig_profile_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"5g\.50gb"):
        driver_config({"gpus": [_gpu(0, migDevices=[_mig(0, "5g.50gb")])]}, "n")


def test_a_shared_gpu_lets_several_claims_consume_its_memory() -> None:
    gpu = _gpu(0)
    config = driver_config({"gpus": [gpu]}, "n", shared=[gpu["uuid"]])
    device = _devices(config)["gpu-0"]
    assert device["allowMultipleAllocations"] is True
    assert device["capacity"] == {
        "memory": {
            "value": "81920Mi",
            "requestPolicy": {"default": "1Gi", "validRange": {"min": "1Gi", "step": "1Gi"}},
        }
    }
    assert config["devices"]["gpu-0"] == {"uuid": gpu["uuid"], "shared": True, "parent": "gpu-0"}


def test_a_partitionable_gpu_offers_every_mig_placement_from_its_counters() -> None:
    """KEP-4815 as NVIDIA's driver publishes it on 1.35 and later: the counter sets in a slice
    of their own first, then one slice of devices per GPU; the whole GPU consumes every
    counter, each MIG device its memory and its memory slices; MIG devices have no UUID."""
    parted, whole = _gpu(0), _gpu(1, A100_40, 40960)
    config = driver_config({"gpus": [parted, whole]}, "n", partitionable=[parted["uuid"]])
    counters, first, second = config["slices"]
    everything = {"memory": {"value": "81920Mi"}}
    everything.update({f"memory-slice-{i}": {"value": "1"} for i in range(8)})
    assert counters == {"sharedCounters": [{"name": "gpu-0-counter-set", "counters": everything}]}
    assert [d["name"] for d in second["devices"]] == ["gpu-1"]
    names = [d["name"] for d in first["devices"]]
    assert names == [
        "gpu-0",
        *(f"gpu-0-mig-1g10gb-19-{s}" for s in range(7)),
        *(f"gpu-0-mig-2g20gb-14-{s}" for s in (0, 2, 4)),
        "gpu-0-mig-3g40gb-9-0",
        "gpu-0-mig-3g40gb-9-4",
        "gpu-0-mig-4g40gb-5-0",
        "gpu-0-mig-7g80gb-0-0",
    ]
    by_name = {d["name"]: d for d in first["devices"]}
    assert by_name["gpu-0"]["consumesCounters"] == [
        {"counterSet": "gpu-0-counter-set", "counters": everything}
    ]
    two = by_name["gpu-0-mig-2g20gb-14-4"]
    assert two["consumesCounters"] == [
        {
            "counterSet": "gpu-0-counter-set",
            "counters": {
                "memory": {"value": "20480Mi"},
                "memory-slice-4": {"value": "1"},
                "memory-slice-5": {"value": "1"},
            },
        }
    ]
    assert "uuid" not in two["attributes"]
    assert config["devices"]["gpu-0-mig-2g20gb-14-4"] == {
        "parentUUID": parted["uuid"],
        "profile": "2g.20gb",
        "parent": "gpu-0",
    }
    assert config["devices"]["gpu-0"] == {"uuid": parted["uuid"], "parent": "gpu-0"}


def test_partition_profiles_are_named_after_the_gpus_memory() -> None:
    gpu = _gpu(0, A100_40, 40960)
    config = driver_config({"gpus": [gpu]}, "n", partitionable=[gpu["uuid"]])
    profiles = {_attrs(d).get("profile") for d in _devices(config).values()}
    assert profiles == {None, "1g.5gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb"}


@pytest.mark.parametrize(
    ("gpus", "shared", "partitionable", "said"),
    [
        ([_gpu(0)], ["GPU-nope"], [], "shared names GPUs the scenario lacks: GPU-nope"),
        ([_gpu(0)], [_gpu(0)["uuid"]], [_gpu(0)["uuid"]], "both shared and partitionable"),
        ([_gpu(0, migDevices=[])], [], [_gpu(0)["uuid"]], "MIG devices made beforehand"),
    ],
)
def test_options_the_scenario_cannot_hold_are_refused(
    gpus: list[dict[str, Any]], shared: list[str], partitionable: list[str], said: str
) -> None:
    with pytest.raises(ValueError, match=said):
        driver_config({"gpus": gpus}, "n", shared=shared, partitionable=partitionable)


def test_a_made_up_mig_uuid_is_one_per_claim_and_a_valid_mig_uuid() -> None:
    one = dynamic_mig_uuid("GPU-1", "gpu-0-mig-1g10gb-19-0", "claim-1")
    assert one == dynamic_mig_uuid("GPU-1", "gpu-0-mig-1g10gb-19-0", "claim-1")
    assert one != dynamic_mig_uuid("GPU-1", "gpu-0-mig-1g10gb-19-0", "claim-2")
    assert re.match(MIG_UUID_PATTERN, one)
    assert one[19] in "89ab"  # an RFC 4122 variant, version 4


def test_device_classes_are_nvidias() -> None:
    gpu, mig = device_classes()
    assert (gpu["metadata"]["name"], mig["metadata"]["name"]) == (
        "gpu.nvidia.com",
        "mig.nvidia.com",
    )
    assert gpu["spec"]["extendedResourceName"] == "nvidia.com/gpu"
    assert gpu["spec"]["selectors"] == [
        {
            "cel": {
                "expression": "device.driver == 'gpu.nvidia.com' && "
                "device.attributes['gpu.nvidia.com'].type == 'gpu'"
            }
        }
    ]
    assert "extendedResourceName" not in device_classes(None)[0]["spec"]


def test_the_wrapper_runs_the_driver_with_its_folders(tmp_path: Path) -> None:
    plugin = DraPlugin(
        DEFAULT_SCENARIO, "node-a", tmp_path / "kc", tmp_path / "f", cdi_dir=tmp_path / "cdi",
        binary=Path("/bin/true"),
    )  # fmt: skip
    assert plugin.registration_socket == REGISTRAR_DIR / "gpu.nvidia.com-reg.sock"
    assert plugin.dra_socket == PLUGINS_DIR / "gpu.nvidia.com" / "dra.sock"
    assert plugin.argv() == [
        "/bin/true",
        f"--config={tmp_path / 'f' / 'config.json'}",
        f"--kubeconfig={tmp_path / 'kc'}",
        "--node-name=node-a",
        f"--registrar-dir={REGISTRAR_DIR}",
        f"--plugin-data-dir={PLUGINS_DIR / 'gpu.nvidia.com'}",
        f"--cdi-dir={tmp_path / 'cdi'}",
        f"--status={tmp_path / 'f' / 'status.log'}",
    ]
    assert cdi_spec_path(tmp_path, "u-1") == tmp_path / "k8s.gpu.nvidia.com-claim_u-1.json"
    assert CDI_KIND == "k8s.gpu.nvidia.com/claim"


def test_the_wrapper_reads_what_the_driver_prepared(tmp_path: Path) -> None:
    plugin = DraPlugin(
        {"gpus": []}, "n", tmp_path / "kc", tmp_path / "f", cdi_dir=tmp_path / "cdi",
        plugin_data_dir=tmp_path / "p", binary=Path("/bin/true"),
    )  # fmt: skip
    assert plugin.created_mig_devices() == []
    made = {
        "device": "gpu-0-mig-1g10gb-19-0",
        "uuid": "MIG-x",
        "parentUUID": "GPU-p",
        "profile": "1g.10gb",
        "created": True,
    }
    given = {"device": "gpu-1", "uuid": "GPU-q"}
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "prepared.json").write_text(
        json.dumps({"u-1": {"namespace": "ns", "name": "c", "devices": [made, given]}})
    )
    assert plugin.created_mig_devices() == [
        {
            "uuid": "MIG-x",
            "parentUUID": "GPU-p",
            "profile": "1g.10gb",
            "device": "gpu-0-mig-1g10gb-19-0",
            "claim": "u-1",
        }
    ]


def test_status_lines_count_from_the_last_start(tmp_path: Path) -> None:
    plugin = DraPlugin(
        {"gpus": []}, "n", tmp_path / "kc", tmp_path, cdi_dir=tmp_path, binary=Path("/bin/true")
    )
    plugin.status_log.write_text("serving a b\npublished 1\nregistered\n")
    plugin._since = plugin.status_log.stat().st_size
    with plugin.status_log.open("a") as out:
        out.write("serving a b\n")
    assert plugin._said("serving")
    assert not plugin._said("registered")
    assert not plugin.wait_registered(0.2)


def _encoded(number: int, payload: bytes) -> bytes:
    return message_field(number, payload)


def test_prepare_encodes_claims_and_decodes_devices_as_the_kubelets_api_has_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sent: list[tuple[str, bytes]] = []
    device = (
        _encoded(1, b"gpu")
        + _encoded(2, b"node-a")
        + _encoded(3, b"gpu-1")
        + _encoded(4, b"k8s.gpu.nvidia.com/claim=u-1-gpu-1-s")
        + _encoded(5, b"s")
    )
    entry = _encoded(1, b"u-1") + _encoded(2, _encoded(1, device))
    failed = _encoded(1, b"u-2") + _encoded(2, _encoded(2, b"not allocated"))

    def unary(path: Path, method: str, request: bytes, timeout: float) -> bytes:
        sent.append((method, request))
        return _encoded(1, entry) + _encoded(1, failed)

    monkeypatch.setattr(kubeletcalls, "unary", unary)
    results = kubeletcalls.prepare(Path("/s"), [Claim("ns", "c", "u-1"), Claim("ns", "d", "u-2")])
    ((method, request),) = sent
    assert method == "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources"
    claims = [bytes(v) for n, _, v in fields(memoryview(request)) if n == 1]
    assert claims[0] == _encoded(1, b"ns") + _encoded(2, b"u-1") + _encoded(3, b"c")
    assert results["u-1"] == kubeletcalls.PrepareResult(
        (
            kubeletcalls.PreparedDevice(
                ("gpu",), "node-a", "gpu-1", ("k8s.gpu.nvidia.com/claim=u-1-gpu-1-s",), "s"
            ),
        ),
        "",
    )
    assert results["u-2"] == kubeletcalls.PrepareResult((), "not allocated")
