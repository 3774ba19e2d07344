"""Which GPU a DRA device is, from the CDI specs on the node: a table of spec layouts (the
NVIDIA DRA driver's, env-style drivers', the container toolkit's static spec, broken and
ambiguous ones), each resolved to exactly one UUID of the node or to none, never an error."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuusage.api.models import Gpu, MigDevice
from gpuusage_nodeagent.podresources.cdi import (
    MAX_SPEC_BYTES,
    Edits,
    NodeGpus,
    SpecDirs,
    parse_spec,
    resolve,
)
from tests.fakenvml import gpu_uuid, mig_uuid

GPU0, GPU1, GPU2 = gpu_uuid(0), gpu_uuid(1), gpu_uuid(2)
MIG10, MIG11 = mig_uuid(10), mig_uuid(11)
OTHER_NODE = gpu_uuid(99)
CLAIM = "0e0a4ce4-1f4c-4a0c-9a57-3a1c2b6d1f00"

NODE = NodeGpus.of(
    [
        Gpu(index=0, uuid=GPU0, minor_number=0, mig_enabled=False),
        Gpu(
            index=1,
            uuid=GPU1,
            minor_number=1,
            mig_enabled=True,
            mig_devices=[MigDevice(index=0, uuid=MIG10), MigDevice(index=1, uuid=MIG11)],
        ),
        Gpu(index=2, uuid=GPU2, minor_number=3, mig_enabled=None),  # its MIG mode unread
    ]
)


def nodes(*paths: str) -> dict[str, Any]:
    return {"deviceNodes": [{"path": p, "hostPath": p, "permissions": "rw"} for p in paths]}


def env(*entries: str) -> dict[str, Any]:
    return {"env": list(entries)}


def spec(
    kind: str, devices: dict[str, dict[str, Any]], common: dict[str, Any] | None = None
) -> Any:
    """A CDI spec of `kind` with `devices` (name → containerEdits) and spec-wide edits."""
    body: dict[str, Any] = {
        "cdiVersion": "0.6.0",
        "kind": kind,
        "devices": [{"name": n, "containerEdits": e} for n, e in devices.items()],
    }
    if common is not None:
        body["containerEdits"] = common
    return body


NVIDIA_COMMON = {
    "env": ["NVIDIA_VISIBLE_DEVICES=void"],
    "deviceNodes": [{"path": "/dev/nvidiactl"}, {"path": "/dev/nvidia-uvm"}],
    "mounts": [{"hostPath": "/usr/lib/libcuda.so.1", "containerPath": "/usr/lib/libcuda.so.1"}],
    "hooks": [{"hookName": "createContainer", "path": "/usr/bin/nvidia-cdi-hook"}],
}
"""What NVIDIA's k8s-dra-driver-gpu writes spec-wide in a claim's spec: the driver's files and
NVIDIA_VISIBLE_DEVICES=void (the runtime's own injection off)."""


def nvidia_claim(*devices: tuple[str, dict[str, Any]]) -> Any:
    """A claim's spec as NVIDIA's k8s-dra-driver-gpu writes it (kind k8s.gpu.nvidia.com/claim,
    devices named <claim UID>-<device>, GPUs named by their device nodes only)."""
    return spec("k8s.gpu.nvidia.com/claim", {f"{CLAIM}-{n}": e for n, e in devices}, NVIDIA_COMMON)


def claim_name(device: str) -> str:
    return f"k8s.gpu.nvidia.com/claim={CLAIM}-{device}"


CASES: list[tuple[str, Any, list[str], str | None]] = [
    # (what, the spec (or specs), the CDI devices handed, the UUID)
    (
        "NVIDIA's DRA driver: a GPU by its device node",
        nvidia_claim(("gpu-0", nodes("/dev/nvidia0", "/dev/dri/card1"))),
        [claim_name("gpu-0")],
        GPU0,
    ),
    (
        "NVIDIA's DRA driver: a MIG device (its GPU's node and the caps nodes) is not told",
        nvidia_claim(
            (
                "gpu-1-mig-1g10gb-0-0",
                nodes(
                    "/dev/nvidia1", "/dev/nvidia-caps/nvidia-cap30", "/dev/nvidia-caps/nvidia-cap31"
                ),
            )
        ),
        [claim_name("gpu-1-mig-1g10gb-0-0")],
        None,
    ),
    (
        "a device node of a GPU whose MIG mode is unknown is not told",
        nvidia_claim(("gpu-3", nodes("/dev/nvidia3"))),
        [claim_name("gpu-3")],
        None,
    ),
    (
        "a device node of no GPU of the node",
        nvidia_claim(("gpu-7", nodes("/dev/nvidia7"))),
        [claim_name("gpu-7")],
        None,
    ),
    (
        "env: a GPU UUID",
        spec("example.com/gpu", {"a": env(f"NVIDIA_VISIBLE_DEVICES={GPU0}")}),
        ["example.com/gpu=a"],
        GPU0,
    ),
    (
        "env: a MIG UUID, with its GPU's device node",
        spec(
            "example.com/gpu",
            {"m": {**env(f"NVIDIA_VISIBLE_DEVICES={MIG11}"), **nodes("/dev/nvidia1")}},
        ),
        ["example.com/gpu=m"],
        MIG11,
    ),
    (
        "env: a MIG UUID, with another GPU's device node",
        spec(
            "example.com/gpu",
            {"m": {**env(f"NVIDIA_VISIBLE_DEVICES={MIG11}"), **nodes("/dev/nvidia0")}},
        ),
        ["example.com/gpu=m"],
        None,
    ),
    (
        "env: an NVML index",
        spec("example.com/gpu", {"a": env("NVIDIA_VISIBLE_DEVICES=0")}),
        ["example.com/gpu=a"],
        GPU0,
    ),
    (
        "env: a MIG index on its GPU",
        spec("example.com/gpu", {"a": env("NVIDIA_VISIBLE_DEVICES=1:0")}),
        ["example.com/gpu=a"],
        MIG10,
    ),
    (
        "env: spec-wide, for a spec of one device",
        spec("example.com/gpu", {"a": env("OTHER=1")}, env(f"NVIDIA_VISIBLE_DEVICES={GPU2}")),
        ["example.com/gpu=a"],
        GPU2,
    ),
    (
        "env: the same GPU by UUID and by index, and its node",
        spec(
            "example.com/gpu",
            {"a": {**env(f"NVIDIA_VISIBLE_DEVICES={GPU0}"), **nodes("/dev/nvidia0")}},
            env("NVIDIA_VISIBLE_DEVICES=0"),
        ),
        ["example.com/gpu=a"],
        GPU0,
    ),
    (
        "env: two GPUs",
        spec("example.com/gpu", {"a": env(f"NVIDIA_VISIBLE_DEVICES={GPU0},{GPU2}")}),
        ["example.com/gpu=a"],
        None,
    ),
    (
        "env: the device's GPU and another spec-wide",
        spec(
            "example.com/gpu",
            {"a": env(f"NVIDIA_VISIBLE_DEVICES={GPU0}")},
            env(f"NVIDIA_VISIBLE_DEVICES={GPU2}"),
        ),
        ["example.com/gpu=a"],
        None,
    ),
    (
        "env: all",
        spec("example.com/gpu", {"a": env("NVIDIA_VISIBLE_DEVICES=all")}),
        ["example.com/gpu=a"],
        None,
    ),
    (
        "env: a UUID of another node",
        spec("example.com/gpu", {"a": env(f"NVIDIA_VISIBLE_DEVICES={OTHER_NODE}")}),
        ["example.com/gpu=a"],
        None,
    ),
    (
        "env: void and no node: no GPU",
        spec("example.com/gpu", {"a": env("NVIDIA_VISIBLE_DEVICES=void")}),
        ["example.com/gpu=a"],
        None,
    ),
    (
        "two CDI devices, one GPU each",
        spec(
            "example.com/gpu",
            {
                "a": env(f"NVIDIA_VISIBLE_DEVICES={GPU0}"),
                "b": env(f"NVIDIA_VISIBLE_DEVICES={GPU2}"),
            },
        ),
        ["example.com/gpu=a", "example.com/gpu=b"],
        None,
    ),
    (
        "a CDI device with no GPU beside one with a GPU",
        spec(
            "example.com/gpu",
            {"a": env(f"NVIDIA_VISIBLE_DEVICES={GPU0}"), "ctl": nodes("/dev/nvidiactl")},
        ),
        ["example.com/gpu=a", "example.com/gpu=ctl"],
        GPU0,
    ),
    (
        "the container toolkit's static spec: device `all`",
        spec(
            "nvidia.com/gpu",
            {
                "all": nodes("/dev/nvidia0", "/dev/nvidia1", "/dev/nvidia3"),
                "0": nodes("/dev/nvidia0"),
            },
        ),
        ["nvidia.com/gpu=all"],
        None,
    ),
    (
        "the container toolkit's static spec: device `0`",
        spec(
            "nvidia.com/gpu",
            {"all": nodes("/dev/nvidia0", "/dev/nvidia1"), "0": nodes("/dev/nvidia0")},
        ),
        ["nvidia.com/gpu=0"],
        GPU0,
    ),
    (
        "a CDI device no spec defines",
        spec("example.com/gpu", {"a": env(f"NVIDIA_VISIBLE_DEVICES={GPU0}")}),
        ["example.com/gpu=b"],
        None,
    ),
    (
        "a CDI device of another kind",
        spec("example.com/gpu", {"a": env(f"NVIDIA_VISIBLE_DEVICES={GPU0}")}),
        ["example.com/other=a"],
        None,
    ),
    (
        "no CDI device",
        spec("example.com/gpu", {"a": env(f"NVIDIA_VISIBLE_DEVICES={GPU0}")}),
        [],
        None,
    ),
    (
        "not a CDI name",
        spec("example.com/gpu", {"a": env(f"NVIDIA_VISIBLE_DEVICES={GPU0}")}),
        ["a"],
        None,
    ),
    (
        "defined twice in one folder",
        [
            spec("example.com/gpu", {"a": env(f"NVIDIA_VISIBLE_DEVICES={GPU0}")}),
            spec("example.com/gpu", {"a": env(f"NVIDIA_VISIBLE_DEVICES={GPU0}")}),
        ],
        ["example.com/gpu=a"],
        None,
    ),
]


@pytest.mark.parametrize(
    ("spec_body", "names", "uuid"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_a_spec_layout_resolves_to_one_uuid_or_none(
    tmp_path: Path, spec_body: Any, names: list[str], uuid: str | None
) -> None:
    folder = tmp_path / "cdi"
    folder.mkdir()
    for i, body in enumerate(spec_body if isinstance(spec_body, list) else [spec_body]):
        (folder / f"spec-{i}.yaml").write_text(yaml.safe_dump(body))
    assert resolve(names, SpecDirs([folder]).devices(), NODE) == uuid


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"{",
        b"- a list\n",
        b"kind: example.com/gpu\n",  # no devices
        b"kind: nokind\ndevices: []\n",
        b"kind: example.com/gpu\ndevices: [{containerEdits: {}}]\n",  # a device without a name
        b"kind: example.com/gpu\ndevices: [{name: a}, {name: a}]\n",
        b"kind: example.com/gpu\ndevices: [7]\n",
        b"kind: example.com/gpu\ndevices: [{name: a}]\n\xff\xfe",  # not UTF-8
        b"kind: example.com/gpu\ndevices: [{name: a, containerEdits: {env: 5}}]\n",
        b"kind: example.com/gpu\ncontainerEdits: {deviceNodes: true}\ndevices: [{name: a}]\n",
    ],
)
def test_a_broken_spec_leaves_its_devices_unknown_and_the_others_known(
    tmp_path: Path, data: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    """Never an error that stops the cycle: the broken file is logged once, the good one read."""
    folder = tmp_path / "cdi"
    folder.mkdir()
    (folder / "broken.yaml").write_bytes(data)
    good = spec("example.com/good", {"a": env(f"NVIDIA_VISIBLE_DEVICES={GPU0}")})
    (folder / "good.json").write_text(json.dumps(good))
    specs = SpecDirs([folder])
    with caplog.at_level(logging.WARNING):
        first, second = specs.devices(), specs.devices()
    assert first == second
    assert resolve(["example.com/good=a"], first, NODE) == GPU0
    assert resolve(["example.com/gpu=a"], first, NODE) is None
    assert len([r for r in caplog.records if "broken.yaml" in r.getMessage()]) == 1


def test_a_later_folder_wins_and_only_json_and_yaml_at_the_top_are_read(tmp_path: Path) -> None:
    """As the CDI library reads them: /var/run/cdi after /etc/cdi; other files and sub-folders
    are no specs."""
    etc, run = tmp_path / "etc", tmp_path / "run"
    for folder in (etc, run, run / "sub"):
        folder.mkdir()
    (etc / "a.yaml").write_text(
        yaml.safe_dump(spec("example.com/gpu", {"a": env(f"NVIDIA_VISIBLE_DEVICES={GPU0}")}))
    )
    (run / "a.json").write_text(
        json.dumps(spec("example.com/gpu", {"a": env(f"NVIDIA_VISIBLE_DEVICES={GPU2}")}))
    )
    (run / "b.yml").write_text(
        yaml.safe_dump(spec("example.com/gpu", {"b": env(f"NVIDIA_VISIBLE_DEVICES={GPU0}")}))
    )
    (run / "sub" / "c.yaml").write_text(
        yaml.safe_dump(spec("example.com/gpu", {"c": env(f"NVIDIA_VISIBLE_DEVICES={GPU0}")}))
    )
    found = SpecDirs([etc, run, tmp_path / "absent"]).devices()
    assert resolve(["example.com/gpu=a"], found, NODE) == GPU2
    assert set(found) == {"example.com/gpu=a"}


def test_specs_are_parsed_once_per_change_and_forgotten_when_removed(tmp_path: Path) -> None:
    folder = tmp_path / "cdi"
    folder.mkdir()
    path = folder / "claim.yaml"
    path.write_text(yaml.safe_dump(nvidia_claim(("gpu-0", nodes("/dev/nvidia0")))))
    specs = SpecDirs([folder])
    for _ in range(3):
        assert resolve([claim_name("gpu-0")], specs.devices(), NODE) == GPU0
    assert specs.parses == 1
    path.write_text(yaml.safe_dump(nvidia_claim(("gpu-0", nodes("/dev/nvidia3", "/dev/nvidia0")))))
    os.utime(path, ns=(1, 1))  # a rewrite within the clock's tick is still a change of size
    assert resolve([claim_name("gpu-0")], specs.devices(), NODE) is None
    assert specs.parses == 2
    path.unlink()
    assert specs.devices() == {}


def test_a_spec_too_large_is_not_read(tmp_path: Path) -> None:
    folder = tmp_path / "cdi"
    folder.mkdir()
    body = spec("example.com/gpu", {"a": env(f"NVIDIA_VISIBLE_DEVICES={GPU0}")})
    body["pad"] = "x" * MAX_SPEC_BYTES
    (folder / "big.json").write_text(json.dumps(body))
    assert SpecDirs([folder]).devices() == {}


def test_parse_keeps_only_what_tells_the_gpu() -> None:
    text = json.dumps(nvidia_claim(("gpu-0", nodes("/dev/nvidia0", "/dev/dri/card1"))))
    found = parse_spec(text, json_format=True)
    assert found == {claim_name("gpu-0"): Edits(visible=("void",), nodes=("/dev/nvidia0",))}


def test_a_device_node_number_too_long_to_be_a_minor_names_no_gpu(tmp_path: Path) -> None:
    folder = tmp_path / "cdi"
    folder.mkdir()
    node = {"path": "/dev/nvidia" + "9" * 5000}
    body = spec("example.com/gpu", {"a": {"deviceNodes": [node]}})
    (folder / "huge.json").write_text(json.dumps(body))
    assert resolve(["example.com/gpu=a"], SpecDirs([folder]).devices(), NODE) is None
