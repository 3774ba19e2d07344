"""The kubelet's PodResources API: the agent's client against a server built from the kubelet's
own generated code and gRPC server (the fake kubelet), and the pure parts on their own."""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.errors import ErrorCodes
from h2.events import RequestReceived

from gpuusage.api.models import (
    MAX_KUBELET_CLAIM_DEVICES,
    MAX_KUBELET_DEVICES,
    MAX_KUBELET_PODS,
    MAX_KUBELET_REPLICAS,
    MAX_POD_CLAIM_DEVICES,
    MAX_POD_REPLICATED,
    DeviceReplicas,
    Gpu,
    GpuNodeUsage,
    MigDevice,
)
from gpuusage_dev.fakekubelet import FakeKubelet
from gpuusage_dev.proctree import write_process
from gpuusage_nodeagent.main import run_agent
from gpuusage_nodeagent.podresources.cdi import SpecDirs
from gpuusage_nodeagent.podresources.client import CallError, unary
from gpuusage_nodeagent.podresources.kubelet import (
    GET,
    Kubelet,
    allocations,
    device_aliases,
    get_nothing,
    get_verdict,
    list_allocatable,
    list_pods,
    own_cdi_devices,
    replicated,
)
from gpuusage_nodeagent.podresources.wire import (
    ClaimResource,
    ContainerDevices,
    ContainerResources,
    DynamicResource,
    PodResources,
    WireError,
    allocatable_response,
    get_request,
    get_response,
    list_response,
)
from gpuusage_nodeagent.settings import AgentSettings
from tests.fakenvml import gpu_uuid, mig_uuid

GPU0, GPU1, MIG0 = gpu_uuid(0), gpu_uuid(1), mig_uuid(0)


def pod(name: str, *devices: tuple[str, list[str]], namespace: str = "ml") -> dict[str, Any]:
    """A pod as the kubelet lists it (protobuf field names), one container per device entry."""
    return {
        "name": name,
        "namespace": namespace,
        "containers": [
            {"name": f"c{i}", "devices": [{"resource_name": r, "device_ids": ids}]}
            for i, (r, ids) in enumerate(devices)
        ],
    }


@pytest.fixture
def kubelet(tmp_path: Path) -> Iterator[FakeKubelet]:
    with FakeKubelet(tmp_path / "pod-resources" / "kubelet.sock") as fake:
        yield fake


# -- the client against the real protocol ------------------------------------------------------


def test_list_decodes_every_pod_container_and_device(kubelet: FakeKubelet) -> None:
    """Fields the agent does not read (CPU IDs and memory, the pod's own too, topology) are
    skipped; the DRA devices are read."""
    busy = pod("train", ("nvidia.com/gpu", [GPU0, GPU1]), ("example.com/nic", ["eth1"]))
    busy.update(cpu_ids=[4, 5], memory=[{"memory_type": "memory", "size": 1 << 30}])
    busy["containers"][0].update(
        cpu_ids=[2, 3],
        memory=[{"memory_type": "memory", "size": 1 << 40, "topology": {"nodes": [{"ID": 1}]}}],
        dynamic_resources=[
            {
                "claim_name": "c",
                "claim_namespace": "ml",
                "claim_resources": [{"driver_name": "gpu.nvidia.com", "device_name": "gpu-0"}],
            }
        ],
    )
    busy["containers"][0]["devices"][0]["topology"] = {"nodes": [{"ID": 0}]}
    kubelet.pods(busy, pod("web", namespace="default"))
    pods = list_response(list_pods(kubelet.socket, 5))
    assert pods == [
        PodResources(
            "train",
            "ml",
            (
                ContainerResources(
                    "c0",
                    (ContainerDevices("nvidia.com/gpu", (GPU0, GPU1)),),
                    (
                        DynamicResource(
                            "c", "ml", (ClaimResource("gpu.nvidia.com", "", "gpu-0", (), None),)
                        ),
                    ),
                ),
                ContainerResources("c1", (ContainerDevices("example.com/nic", ("eth1",)),)),
            ),
        ),
        PodResources("web", "default", ()),
    ]


def test_allocatable_decodes_the_devices_the_plugins_advertise(kubelet: FakeKubelet) -> None:
    """GetAllocatableResources on the kubelet's own server: the devices by resource, each
    replica of a time-sliced GPU its own ID; CPU IDs and memory skipped."""
    replicas = [f"{GPU0}::{n}" for n in range(4)]
    kubelet.answer(
        {
            "allocatable": {
                "devices": [
                    {"resource_name": "nvidia.com/gpu", "device_ids": replicas},
                    {"resource_name": "nvidia.com/mig-1g.10gb", "device_ids": [MIG0]},
                ],
                "cpu_ids": [0, 1, 2],
                "memory": [{"memory_type": "memory", "size": 1 << 40}],
            }
        }
    )
    assert allocatable_response(list_allocatable(kubelet.socket, 5)) == [
        ContainerDevices("nvidia.com/gpu", tuple(replicas)),
        ContainerDevices("nvidia.com/mig-1g.10gb", (MIG0,)),
    ]


def test_a_large_answer_arrives_whole(kubelet: FakeKubelet) -> None:
    """Thousands of pods (over 1 MB, many HTTP/2 frames and flow-control windows)."""
    many = [pod(f"p-{i:05d}", ("nvidia.com/gpu", [gpu_uuid(i % 8)])) for i in range(6000)]
    kubelet.pods(*many)
    pods = list_response(list_pods(kubelet.socket, 10))
    assert len(pods) == 6000
    assert pods[-1].name == "p-05999"
    assert pods[-1].containers[0].devices[0].device_ids == (gpu_uuid(5999 % 8),)


def test_a_grpc_error_is_said_with_its_code_and_message(kubelet: FakeKubelet) -> None:
    kubelet.answer({"error": {"code": 14, "message": "pod resources 100% busy: try later"}})
    with pytest.raises(CallError, match=r"^Unavailable: pod resources 100% busy: try later$"):
        list_pods(kubelet.socket, 5)
    kubelet.answer({"error": {"code": 8, "message": ""}})
    with pytest.raises(CallError, match=r"^ResourceExhausted$"):
        list_pods(kubelet.socket, 5)


def test_a_slow_kubelet_times_out(kubelet: FakeKubelet) -> None:
    kubelet.answer({"pod_resources": [], "delay_ms": 3000})
    with pytest.raises(CallError, match=r"no answer within 0.3s"):
        list_pods(kubelet.socket, 0.3)


@contextlib.contextmanager
def one_connection(path: Path, serve: Callable[[socket.socket], None]) -> Iterator[None]:
    """A unix socket at `path` whose first connection `serve` answers, in a thread."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(1)

    def accept() -> None:
        conn, _ = server.accept()
        # the client may close as soon as it has its answer
        with conn, contextlib.suppress(BrokenPipeError, ConnectionResetError):
            serve(conn)

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield
    finally:
        server.close()


def answering(respond: Callable[[H2Connection, int], None]) -> Callable[[socket.socket], None]:
    """An HTTP/2 server for one connection that answers each request with `respond`."""

    def serve(conn: socket.socket) -> None:
        h2 = H2Connection(H2Configuration(client_side=False))
        h2.initiate_connection()
        conn.sendall(h2.data_to_send())
        while data := conn.recv(65536):
            for event in h2.receive_data(data):
                if isinstance(event, RequestReceived):
                    respond(h2, event.stream_id)
            conn.sendall(h2.data_to_send())

    return serve


def test_a_reset_before_the_deadline_is_no_timeout(tmp_path: Path) -> None:
    """The fake kubelet cancels a call whose grpc-timeout passed (RST_STREAM CANCEL), which the
    client calls a timeout; a server that resets the stream at once is said to have done so."""

    def reset(h2: H2Connection, stream: int) -> None:
        h2.reset_stream(stream, ErrorCodes.CANCEL)

    with (
        one_connection(tmp_path / "resets.sock", answering(reset)),
        pytest.raises(CallError, match=r"reset the stream \(HTTP/2 error 8\)"),
    ):
        list_pods(tmp_path / "resets.sock", 30)


def test_a_deadline_the_server_reports_is_a_timeout(tmp_path: Path) -> None:
    """A gRPC server may also answer DEADLINE_EXCEEDED (trailers only) when the grpc-timeout
    passes, just before the client's own timeout: the same "no answer" either way."""

    def deadline(h2: H2Connection, stream: int) -> None:
        h2.send_headers(
            stream,
            [
                (":status", "200"),
                ("content-type", "application/grpc"),
                ("grpc-status", "4"),
                ("grpc-message", "context deadline exceeded"),
            ],
            end_stream=True,
        )

    with (
        one_connection(tmp_path / "deadline.sock", answering(deadline)),
        pytest.raises(CallError, match=r"no answer within 30s \(DeadlineExceeded: context"),
    ):
        list_pods(tmp_path / "deadline.sock", 30)


def test_a_server_that_is_not_grpc_is_said_so(tmp_path: Path) -> None:
    """Something else on the socket (HTTP/1.1 answering, then closing) is a clear error."""

    def http(conn: socket.socket) -> None:
        conn.recv(4096)
        conn.sendall(b"HTTP/1.1 400 Bad Request\r\nConnection: close\r\n\r\n")

    with (
        one_connection(tmp_path / "not-grpc.sock", http),
        pytest.raises(CallError, match=r"protocol error|closed the connection"),
    ):
        list_pods(tmp_path / "not-grpc.sock", 5)


# -- the agent's reader: every failure becomes a said Unavailable ------------------------------


def test_the_reader_publishes_gpu_pods_and_says_each_failure(
    kubelet: FakeKubelet, caplog: pytest.LogCaptureFixture
) -> None:
    reader = Kubelet(kubelet.socket, 2.0, refresh=0)  # asks every time
    kubelet.pods(pod("train", ("nvidia.com/gpu", [f"{GPU0}::3", f"{GPU0}::4"])), pod("web"))
    read = reader.read()
    assert read is not None
    assert read.state == "Read"
    assert [(p.name, p.devices, p.resources) for p in read.pods] == [
        ("train", [GPU0], ["nvidia.com/gpu"])
    ]
    kubelet.answer({"error": {"code": 14, "message": "restarting"}})
    with caplog.at_level(logging.WARNING):
        first, second = reader.read(), reader.read()
    assert first == second
    assert first is not None
    assert first.state == "Unavailable"
    assert first.message == "kubelet PodResources: Unavailable: restarting"
    assert first.pods == []
    assert len([r for r in caplog.records if "restarting" in r.getMessage()]) == 1
    kubelet.stop()
    kubelet.socket.unlink(missing_ok=True)
    gone = reader.read()
    assert gone is not None
    assert gone.state == "Unavailable"
    assert "kubelet.sock not found" in (gone.message or "")


def test_the_reader_publishes_replicas_and_says_why_it_cannot(
    kubelet: FakeKubelet, caplog: pytest.LogCaptureFixture
) -> None:
    """A GPU the device plugin shares as 4 time-slicing replicas, a pod given 2 of them and one
    given 1; a kubelet that cannot answer GetAllocatableResources (the feature gate off, before
    1.28) leaves the pods' devices known and the replicas unknown, with the reason."""
    reader = Kubelet(kubelet.socket, 2.0, refresh=0)
    pods = (
        pod("two", ("nvidia.com/gpu", [f"{GPU0}::0", f"{GPU0}::3"])),
        pod("one", ("nvidia.com/gpu", [f"{GPU0}::1"])),
        pod("whole", ("nvidia.com/gpu", [GPU1])),
    )
    advertised = {"nvidia.com/gpu": [*(f"{GPU0}::{n}" for n in range(4)), GPU1]}
    kubelet.pods(*pods, advertised=advertised)
    read = reader.read()
    assert read is not None
    assert read.replicated == [DeviceReplicas(device=GPU0, replicas=4)]
    assert read.replicas_message is None
    assert {p.name: p.replicas for p in read.pods} == {
        "two": [DeviceReplicas(device=GPU0, replicas=2)],
        "one": [DeviceReplicas(device=GPU0, replicas=1)],
        "whole": [],
    }
    answer = json.loads(kubelet.answers.read_text())
    answer["allocatable_error"] = {"code": 12, "message": "GetAllocatableResources disabled"}
    kubelet.answer(answer)
    with caplog.at_level(logging.WARNING):
        first, second = reader.read(), reader.read()
    assert first == second
    assert first is not None
    assert first.state == "Read"
    assert [p.name for p in first.pods] == ["one", "two", "whole"]
    assert first.replicated == []
    assert first.replicas_message == (
        "GetAllocatableResources: Unimplemented: GetAllocatableResources disabled"
    )
    assert len([r for r in caplog.records if "allocatable" in r.getMessage()]) == 1


def test_the_kubelet_is_asked_when_a_new_pod_appears_after_a_failure_and_to_refresh(
    tmp_path: Path,
) -> None:
    (tmp_path / "pr").mkdir()
    now = [0.0]
    answers = [b"", b"\x0a\xff", b"", b"", b""]  # empty lists, and once a broken answer
    reader = Kubelet(
        tmp_path / "pr" / "kubelet.sock",
        1.0,
        refresh=60,
        lister=lambda *_: answers.pop(0),
        clock=lambda: now[0],
    )
    assert reader.read({"a"}).state == "Read"  # type: ignore[union-attr]
    assert reader.read({"a"}) is reader.read(set())  # nothing new: the last answer
    assert reader.asked == 1
    assert reader.read({"a", "b"}).state == "Unavailable"  # type: ignore[union-attr]
    assert reader.read({"a", "b"}).state == "Read"  # type: ignore[union-attr]
    assert reader.asked == 3, "a failure is asked again the next cycle"
    now[0] = 59.0
    reader.read({"b"})
    assert reader.asked == 3
    now[0] = 61.0
    reader.read({"b"})
    assert reader.asked == 4, "refreshed once a minute"


def test_the_reader_is_off_without_the_mounted_folder(tmp_path: Path) -> None:
    reader = Kubelet(tmp_path / "absent" / "kubelet.sock", 1.0)
    assert reader.read() is None


def test_the_reader_says_an_answer_it_cannot_decode(tmp_path: Path) -> None:
    (tmp_path / "pr").mkdir()
    reader = Kubelet(tmp_path / "pr" / "kubelet.sock", 1.0, lister=lambda *_: b"\x0a\xff")
    read = reader.read()
    assert read is not None
    assert read.state == "Unavailable"
    assert "not a ListPodResourcesResponse" in (read.message or "")


# -- pure: what is published -------------------------------------------------------------------


def _pods(*pods: dict[str, Any]) -> list[PodResources]:
    return [
        PodResources(
            p["name"],
            p["namespace"],
            tuple(
                ContainerResources(
                    c["name"],
                    tuple(
                        ContainerDevices(d["resource_name"], tuple(d["device_ids"]))
                        for d in c["devices"]
                    ),
                )
                for c in p["containers"]
            ),
        )
        for p in pods
    ]


def test_devices_are_published_once_per_device_with_replicas_folded() -> None:
    found = allocations(
        _pods(
            pod("a", ("nvidia.com/gpu", [f"{GPU1}::0", GPU0]), ("nvidia.com/gpu", [f"{GPU1}::1"])),
            pod("b", ("nvidia.com/mig-1g.10gb", [MIG0])),
            pod("cpu-only", ("example.com/nic", ["eth0"])),
        )
    )
    assert [(p.name, p.resources, p.devices, p.other_devices) for p in found.pods] == [
        ("a", ["nvidia.com/gpu"], sorted([GPU0, GPU1]), 0),
        ("b", ["nvidia.com/mig-1g.10gb"], [MIG0], 0),
    ]


def test_replicas_are_counted_by_device_through_the_aliases() -> None:
    """NVIDIA's plugin advertises a time-sliced GPU as `<id>::<n>`, under its index as well
    (deviceIDStrategy=index), a MIG device's replicas too; devices advertised once, IDs of
    other resources and IDs that name no device are no replicas."""
    aliases = {"1": GPU1}
    advertised = [
        ContainerDevices("nvidia.com/gpu", (*(f"{GPU0}::{n}" for n in range(3)), "1::0", "1::1")),
        ContainerDevices("nvidia.com/mig-1g.10gb", (f"{MIG0}::0", f"{MIG0}::1")),
        ContainerDevices("nvidia.com/gpu.shared", ("vendor-7::0", "vendor-7::1")),
        ContainerDevices("nvidia.com/gpu", (f"{gpu_uuid(5)}::0",)),  # one replica: the GPU itself
        ContainerDevices("example.com/nic", ("eth0::0", "eth0::1")),
    ]
    assert replicated(advertised, aliases=aliases) == sorted(
        [
            DeviceReplicas(device=GPU0, replicas=3),
            DeviceReplicas(device=GPU1, replicas=2),
            DeviceReplicas(device=MIG0, replicas=2),
        ],
        key=lambda r: r.device,
    )
    found = allocations(
        _pods(
            pod(
                "p",
                ("nvidia.com/gpu", ["1::1", f"{GPU0}::2", f"{GPU0}::0"]),
                ("nvidia.com/gpu", [f"{GPU0}::2"]),  # listed again (another container): one
            )
        ),
        aliases=aliases,
        advertised=advertised,
    )
    assert found.pods[0].replicas == [
        DeviceReplicas(device=GPU0, replicas=2),
        DeviceReplicas(device=GPU1, replicas=1),
    ]
    assert len(found.replicated) == 3


def test_ids_that_are_not_uuids_are_counted_never_listed() -> None:
    """HAMi-style or vendor IDs cannot be matched to a device: the pod's devices are then not
    known one by one, which the operator reads as 'do not judge by device'."""
    found = allocations(
        _pods(
            pod("hami", ("nvidia.com/gpu", [f"{GPU0}-3", "gpu-7"])),
            pod("vendor", ("vendor.example/gpu", [GPU1])),
        ),
        extra=["vendor.example/gpu"],
    )
    assert [(p.name, p.devices, p.other_devices) for p in found.pods] == [
        ("hami", [], 2),
        ("vendor", [GPU1], 0),
    ]
    unconfigured = allocations(_pods(pod("vendor", ("vendor.example/gpu", [GPU1]))))
    assert unconfigured.pods == []


def test_bounds_omit_whole_pods_never_part_of_one() -> None:
    many = [
        pod(f"p{i:03d}", ("nvidia.com/gpu", [gpu_uuid(i)])) for i in range(MAX_KUBELET_PODS + 5)
    ]
    found = allocations(_pods(*many))
    assert len(found.pods) == MAX_KUBELET_PODS
    assert found.omitted_pods == 5
    wide = [
        pod(f"w{i}", ("nvidia.com/gpu", [gpu_uuid(i * 100 + k) for k in range(100)]))
        for i in range(3)
    ]
    found = allocations(_pods(*wide))
    assert [len(p.devices) for p in found.pods] == [100, 100]
    assert sum(len(p.devices) for p in found.pods) <= MAX_KUBELET_DEVICES
    assert found.omitted_pods == 1


def test_replicas_past_their_bound_leave_a_pods_share_untold_never_its_devices() -> None:
    """Pods holding replicas of 8 GPUs each: once the node's listed replicas would pass
    MAX_KUBELET_REPLICAS, a pod is listed with its devices and without its replicas (its
    handed share then absent, not wrong); the advertised ones are bounded alike."""
    gpus = [gpu_uuid(k) for k in range(MAX_POD_REPLICATED)]
    pods = [
        pod(f"p{i:02d}", ("nvidia.com/gpu", [f"{g}::{i}" for g in gpus]))
        for i in range(MAX_KUBELET_REPLICAS // MAX_POD_REPLICATED + 1)
    ]
    advertised = [
        ContainerDevices(
            "nvidia.com/gpu", tuple(f"{gpu_uuid(k)}::{n}" for k in range(99) for n in (0, 1))
        ),
    ]
    found = allocations(_pods(*pods), advertised=advertised)
    assert [len(p.replicas) for p in found.pods] == [MAX_POD_REPLICATED] * (len(pods) - 1) + [0]
    assert found.pods[-1].devices == sorted(gpus)
    assert len(found.replicated) == MAX_KUBELET_REPLICAS


@pytest.mark.parametrize(
    "data",
    [b"\x0a", b"\x0a\x05ab", b"\x0b", b"\x00\x01", b"\x08\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff"],
)
def test_malformed_bytes_are_refused(data: bytes) -> None:
    with pytest.raises(WireError):
        list_response(data)


# -- the agent publishes it ----------------------------------------------------------------------


def test_the_agent_publishes_the_kubelets_devices(
    kubelet: FakeKubelet, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    scenario = tmp_path / "scenario.yaml"
    scenario.write_text(
        json.dumps({"gpus": [{"index": 0, "uuid": GPU0, "memoryTotalMiB": 81920, "processes": []}]})
    )
    write_process(tmp_path / "proc", 1, "0::/init.scope", comm="init")
    kubelet.pods(pod("train", ("nvidia.com/gpu", [f"{GPU0}::1"])))
    settings = AgentSettings(
        node_name="n1",
        once=True,
        output="json",
        gpu_source=f"fake:{scenario}",
        proc_root=tmp_path / "proc",
        pod_resources_socket=kubelet.socket,
        metrics_port=0,
    )
    assert run_agent(settings) == 0
    report = GpuNodeUsage.model_validate(json.loads(capsys.readouterr().out))
    assert report.spec.kubelet is not None
    assert [(p.namespace, p.name, p.devices) for p in report.spec.kubelet.pods] == [
        ("ml", "train", [GPU0])
    ]


def test_other_plugins_device_ids_are_mapped_to_uuids_or_counted() -> None:
    """NVML index ("0"), MIG device on its GPU ("1:0"), device node ("nvidia7", the minor
    number), a replica of one ("0::3"); an ID naming no device of the node stays counted."""
    mig = MigDevice(index=0, uuid=mig_uuid(0))
    gpus = [
        Gpu(index=0, uuid=GPU0, minor_number=7),
        Gpu(index=1, uuid=GPU1, mig_enabled=True, mig_devices=[mig]),
    ]
    aliases = device_aliases(gpus)
    assert aliases == {"0": GPU0, "nvidia7": GPU0, "1": GPU1, "1:0": mig.uuid}
    given = PodResources(
        "train",
        "ml",
        (
            ContainerResources(
                "c",
                (ContainerDevices("nvidia.com/gpu", ("0::3", "1:0", "nvidia7", "gpu-9")),),
            ),
        ),
    )
    (entry,) = allocations([given], aliases=aliases).pods
    assert (entry.devices, entry.other_devices) == (sorted([GPU0, mig.uuid]), 1)
    (plain,) = allocations([given]).pods
    assert (plain.devices, plain.other_devices) == ([], 4), "without aliases: counted only"


# -- DRA: the devices the kubelet lists per container, with UUIDs from the node's CDI specs -----

CLAIM_UID = "6f1c7a52-3b8e-4c1d-9f2a-0d6e5b4a3c21"
NVIDIA_DRIVER = "gpu.nvidia.com"


def claim(
    name: str, driver: str, *devices: tuple[str, list[str]], pool: str = "node-a"
) -> dict[str, Any]:
    """A container's claim as the kubelet lists it: each device with its CDI devices."""
    return {
        "claim_name": name,
        "claim_namespace": "ml",
        "claim_resources": [
            {
                "driver_name": driver,
                "pool_name": pool,
                "device_name": device,
                "cdi_devices": [{"name": n} for n in cdi],
            }
            for device, cdi in devices
        ],
    }


def dra_pod(name: str, *claims: dict[str, Any], namespace: str = "ml") -> dict[str, Any]:
    return {
        "name": name,
        "namespace": namespace,
        "containers": [{"name": "main", "dynamic_resources": list(claims)}],
    }


def nvidia_cdi(device: str) -> str:
    """The CDI device NVIDIA's DRA driver names for one device of the claim."""
    return f"k8s.gpu.nvidia.com/claim={CLAIM_UID}-{device}"


def write_nvidia_claim_spec(folder: Path, minors: dict[str, int]) -> None:
    """The claim's CDI spec as NVIDIA's DRA driver writes it in /var/run/cdi: one device per
    GPU, named by its device node, and NVIDIA_VISIBLE_DEVICES=void spec-wide."""
    folder.mkdir(parents=True, exist_ok=True)
    body = {
        "cdiVersion": "0.5.0",
        "kind": "k8s.gpu.nvidia.com/claim",
        "devices": [
            {
                "name": f"{CLAIM_UID}-{device}",
                "containerEdits": {"deviceNodes": [{"path": f"/dev/nvidia{minor}"}]},
            }
            for device, minor in minors.items()
        ],
        "containerEdits": {
            "env": ["NVIDIA_VISIBLE_DEVICES=void"],
            "deviceNodes": [{"path": "/dev/nvidiactl"}],
        },
    }
    (folder / f"k8s.gpu.nvidia.com-claim_{CLAIM_UID}.yaml").write_text(json.dumps(body))


NODE_GPUS = [
    Gpu(index=0, uuid=GPU0, minor_number=0, mig_enabled=False),
    Gpu(index=1, uuid=GPU1, minor_number=1, mig_enabled=False),
]

# ListPodResourcesResponse as kubelet 1.37's generated code encodes it (taken from the fake
# kubelet, which is that code): pod p in ns, container c, claim gpu with device gpu-0 of driver
# gpu.nvidia.com in pool n1, CDI device k8s.gpu.nvidia.com/claim=u-gpu-0, share ID s1.
KUBELET_BYTES = bytes.fromhex(
    "0a5c0a017012026e731a530a01632a4e12036770751a026e7322430a220a206b38732e6770752e6e7669"
    "6469612e636f6d2f636c61696d3d752d6770752d30120e6770752e6e76696469612e636f6d1a026e31"
    "22056770752d302a027331"
)
KUBELET_POD = PodResources(
    "p",
    "ns",
    (
        ContainerResources(
            "c",
            (),
            (
                DynamicResource(
                    "gpu",
                    "ns",
                    (
                        ClaimResource(
                            "gpu.nvidia.com",
                            "n1",
                            "gpu-0",
                            ("k8s.gpu.nvidia.com/claim=u-gpu-0",),
                            "s1",
                        ),
                    ),
                ),
            ),
        ),
    ),
)


def test_dra_devices_decode_from_the_kubelets_own_bytes() -> None:
    """Field numbers as api.proto of k8s.io/kubelet v0.37.2 has them: dynamic_resources 5,
    claim_name 2, claim_namespace 3, claim_resources 4, cdi_devices 1, driver 2, pool 3,
    device 4, share_id 5; a GetPodResourcesResponse holds the pod at field 1 as well."""
    assert list_response(KUBELET_BYTES) == [KUBELET_POD]
    assert get_response(KUBELET_BYTES) == KUBELET_POD
    assert get_response(b"") is None
    assert get_request("p", "ns") == bytes.fromhex("0a017012026e73")
    assert get_request("", "") == b""  # proto3 sends no default values


def test_the_fake_kubelet_encodes_as_the_kubelet_and_serves_get(kubelet: FakeKubelet) -> None:
    """The same bytes from the kubelet's generated code; Get answers a pod by name, and for a
    pod it does not have the kubelet's plain error (code Unknown)."""
    body = dra_pod(
        "p",
        claim("gpu", "gpu.nvidia.com", ("gpu-0", ["k8s.gpu.nvidia.com/claim=u-gpu-0"]), pool="n1"),
        namespace="ns",
    )
    body["containers"][0]["name"] = "c"
    body["containers"][0]["dynamic_resources"][0]["claim_namespace"] = "ns"
    body["containers"][0]["dynamic_resources"][0]["claim_resources"][0]["share_id"] = "s1"
    kubelet.pods(body)
    assert list_pods(kubelet.socket, 5) == KUBELET_BYTES
    assert get_response(unary(kubelet.socket, GET, get_request("p", "ns"), 5)) == KUBELET_POD
    with pytest.raises(CallError, match=r"^Unknown: pod  in namespace  not found$"):
        get_nothing(kubelet.socket, 5)


def test_own_cdi_devices_undo_the_kubelets_running_list() -> None:
    """Kubelets 1.35-1.37 give a driver's second device of a claim the first one's CDI
    devices too; a device whose list repeats the one before names nothing of its own; other
    drivers' lists and lists that do not begin with the one before are taken whole."""
    a, b, c, n = "v.com/k=a", "v.com/k=b", "v.com/k=c", "nic.com/k=n"
    resources = [
        ClaimResource("gpu.nvidia.com", "p", "gpu-0", (a,)),
        ClaimResource("gpu.nvidia.com", "p", "gpu-1", (a, b)),
        ClaimResource("gpu.nvidia.com", "p", "gpu-2", (a, b)),  # prepared with no CDI device
        ClaimResource("gpu.nvidia.com", "p", "gpu-3", (a, b, c)),
        ClaimResource("nic.example.com", "p", "nic-0", (n,)),
        ClaimResource("nic.example.com", "p", "nic-1", (c,)),
    ]
    assert own_cdi_devices(resources) == [(a,), (b,), (), (c,), (n,), (c,)]


def test_the_reader_publishes_dra_devices_with_uuids_from_the_cdi_specs(
    kubelet: FakeKubelet, tmp_path: Path
) -> None:
    """A pod given two GPUs by NVIDIA's DRA driver (listed as kubelet 1.37 lists them: the
    second device with the first one's CDI device too) and nothing by a device plugin is
    listed, each device with its GPU's UUID; a NIC of another driver is listed too (the
    operator picks its GPU drivers), without a UUID; no Get is needed."""
    run = tmp_path / "run-cdi"
    write_nvidia_claim_spec(run, {"gpu-0": 0, "gpu-1": 1})
    kubelet.pods(
        dra_pod(
            "train",
            claim(
                "train-gpus",
                NVIDIA_DRIVER,
                ("gpu-0", [nvidia_cdi("gpu-0")]),
                ("gpu-1", [nvidia_cdi("gpu-0"), nvidia_cdi("gpu-1")]),
            ),
        ),
        pod("plugin", ("nvidia.com/gpu", [GPU1])),
        dra_pod("net", claim("net", "nic.example.com", ("nic-0", ["nic.example.com/port=p0"]))),
        pod("web"),
    )
    gets: list[int] = []

    def counted(path: Path, timeout: float) -> bytes:
        gets.append(1)
        return get_nothing(path, timeout)

    reader = Kubelet(kubelet.socket, 2.0, cdi=SpecDirs([tmp_path / "etc-cdi", run]), getter=counted)
    read = reader.read(gpus=NODE_GPUS)
    assert read is not None
    assert read.dra_message is None
    assert {
        p.name: [(d.claim, d.driver, d.pool, d.device, d.uuid) for d in p.claim_devices]
        for p in read.pods
    } == {
        "net": [("net", "nic.example.com", "node-a", "nic-0", None)],
        "plugin": [],
        "train": [
            ("train-gpus", NVIDIA_DRIVER, "node-a", "gpu-0", GPU0),
            ("train-gpus", NVIDIA_DRIVER, "node-a", "gpu-1", GPU1),
        ],
    }
    assert [p.devices for p in read.pods if p.name == "plugin"] == [[GPU1]]
    assert gets == []
    # the same answer on a node whose GPUs are not read yet: no UUID, never a guess
    unread = Kubelet(kubelet.socket, 2.0, cdi=SpecDirs([run])).read()
    assert unread is not None
    assert [d.uuid for p in unread.pods for d in p.claim_devices] == [None, None, None]


def test_without_the_cdi_folders_the_dra_devices_are_listed_and_why_they_have_no_uuid_said(
    kubelet: FakeKubelet, tmp_path: Path
) -> None:
    kubelet.pods(dra_pod("train", claim("g", NVIDIA_DRIVER, ("gpu-0", [nvidia_cdi("gpu-0")]))))
    read = Kubelet(kubelet.socket, 2.0, cdi=SpecDirs([tmp_path / "absent"])).read(gpus=NODE_GPUS)
    assert read is not None
    assert [(d.device, d.uuid) for p in read.pods for d in p.claim_devices] == [("gpu-0", None)]
    assert "no CDI spec folder" in (read.dra_message or "")


PLUGIN_PODS = (
    pod("train", ("nvidia.com/gpu", [GPU0])),
    dra_pod("dra-only", claim("g", NVIDIA_DRIVER, ("gpu-1", [nvidia_cdi("gpu-1")]))),
)


@pytest.mark.parametrize(
    ("version", "said"),
    [
        ("1.37", None),
        ("1.35-gates-off", "KubeletPodResourcesGet gate"),
        ("1.26", "no PodResources Get (before Kubernetes 1.27)"),
    ],
)
def test_a_kubelet_that_lists_no_dra_devices_answers_as_before_and_says_what_it_lacks(
    kubelet: FakeKubelet, tmp_path: Path, version: str, said: str | None
) -> None:
    """Against a kubelet that lists no DRA devices (an older one, or one with the gates off)
    the device-plugin pods are published as before, and `draMessage` says why the DRA devices
    are unknown; kubelet 1.37 with no DRA pod says nothing."""
    pods = PLUGIN_PODS if version != "1.37" else PLUGIN_PODS[:1]
    kubelet.pods(*pods, kubelet=version)
    read = Kubelet(kubelet.socket, 2.0, cdi=SpecDirs([tmp_path])).read(gpus=NODE_GPUS)
    assert read is not None
    assert read.state == "Read"
    assert [(p.name, p.devices, p.claim_devices) for p in read.pods] == [("train", [GPU0], [])]
    if said is None:
        assert read.dra_message is None
    else:
        assert said in (read.dra_message or "")


@pytest.mark.parametrize(
    ("failure", "said"),
    [
        (CallError("Unavailable: restarting"), "Get: Unavailable: restarting: whether the kubelet"),
        (CallError("Unknown: pod  in namespace  not found"), None),
        (CallError("NotFound: no such pod"), None),
        (ConnectionResetError(104, "Connection reset by peer"), "Get: Connection reset by peer"),
        (None, None),  # Get answered (a kubelet that found a pod with no name)
    ],
)
def test_get_verdict(failure: Exception | None, said: str | None) -> None:
    def ask() -> bytes:
        if failure is not None:
            raise failure
        return b""

    verdict = get_verdict(ask)
    assert verdict == said if said is None else (verdict or "").startswith(said)


def test_dra_bounds_count_what_they_leave_out() -> None:
    """A pod with more DRA devices than a pod may list has them counted, never listed in
    part; past the node's bound later pods are listed with theirs counted; a device whose
    names the API does not admit is counted."""
    many = tuple((f"gpu-{i}", [f"k.com/c=d{i}"]) for i in range(MAX_POD_CLAIM_DEVICES + 1))
    wide = PodResources(
        "wide",
        "ml",
        (
            ContainerResources(
                "c",
                (),
                (
                    DynamicResource(
                        "g",
                        "ml",
                        tuple(ClaimResource(NVIDIA_DRIVER, "n", d, tuple(c)) for d, c in many),
                    ),
                ),
            ),
        ),
    )
    bad = PodResources(
        "bad",
        "ml",
        (
            ContainerResources(
                "c",
                (),
                (DynamicResource("g", "ml", (ClaimResource(NVIDIA_DRIVER, "n", "Not_A_Label"),)),),
            ),
        ),
    )
    per_pod = MAX_POD_CLAIM_DEVICES
    fill = [
        PodResources(
            f"p{i:02d}",
            "ml",
            (
                ContainerResources(
                    "c",
                    (),
                    (
                        DynamicResource(
                            "g",
                            "ml",
                            tuple(
                                ClaimResource(NVIDIA_DRIVER, "n", f"gpu-{k}")
                                for k in range(per_pod)
                            ),
                        ),
                    ),
                ),
            ),
        )
        for i in range(MAX_KUBELET_CLAIM_DEVICES // per_pod + 1)
    ]
    found = allocations([wide, bad, *fill])
    by_name = {p.name: (len(p.claim_devices), p.omitted_claim_devices) for p in found.pods}
    assert by_name["wide"] == (0, MAX_POD_CLAIM_DEVICES + 1)
    assert by_name["bad"] == (0, 1)
    assert [by_name[p.name] for p in fill] == [(per_pod, 0)] * (len(fill) - 1) + [(0, per_pod)]
    assert sum(len(p.claim_devices) for p in found.pods) <= MAX_KUBELET_CLAIM_DEVICES


def test_the_agent_publishes_the_dra_devices_with_their_uuids(
    kubelet: FakeKubelet, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The whole agent: the fake GPU source's GPUs (with minor numbers), the fake kubelet's DRA
    pod, the CDI spec in a folder given by --cdi-spec-dirs; the report is valid and says which
    GPU each DRA device is."""
    scenario = tmp_path / "scenario.yaml"
    scenario.write_text(
        json.dumps(
            {
                "gpus": [
                    {
                        "index": 0,
                        "uuid": GPU0,
                        "minorNumber": 0,
                        "memoryTotalMiB": 81920,
                        "processes": [],
                    },
                    {
                        "index": 1,
                        "uuid": GPU1,
                        "minorNumber": 1,
                        "memoryTotalMiB": 81920,
                        "processes": [],
                    },
                ]
            }
        )
    )
    write_process(tmp_path / "proc", 1, "0::/init.scope", comm="init")
    write_nvidia_claim_spec(tmp_path / "run-cdi", {"gpu-1": 1})
    kubelet.pods(
        dra_pod("train", claim("train-gpu", NVIDIA_DRIVER, ("gpu-1", [nvidia_cdi("gpu-1")])))
    )
    settings = AgentSettings(
        node_name="n1",
        once=True,
        output="json",
        gpu_source=f"fake:{scenario}",
        proc_root=tmp_path / "proc",
        pod_resources_socket=kubelet.socket,
        cdi_spec_dirs=f"{tmp_path / 'etc-cdi'},{tmp_path / 'run-cdi'}",
        metrics_port=0,
    )
    assert run_agent(settings) == 0
    published = json.loads(capsys.readouterr().out)
    (train,) = published["spec"]["kubelet"]["pods"]
    assert (train["namespace"], train["name"], train["devices"]) == ("ml", "train", [])
    assert train["claimDevices"] == [
        {
            "claim": "train-gpu",
            "driver": NVIDIA_DRIVER,
            "pool": "node-a",
            "device": "gpu-1",
            "uuid": GPU1,
        }
    ]
    report = GpuNodeUsage.model_validate(published)
    assert report.spec.kubelet is not None
    assert report.spec.kubelet.dra_message is None
