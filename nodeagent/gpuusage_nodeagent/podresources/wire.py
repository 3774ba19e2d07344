"""The kubelet's PodResources v1 messages, from and to protobuf bytes. Pure.

Only the fields gpuusage reads are decoded (pod name and namespace, each container's devices and
the devices DRA drivers prepared for it); every other field, known or added by a later kubelet,
is skipped by its wire type, as protobuf requires of any reader. A hand-written reader of a few
small messages costs the agent nothing to import, where a generated module would bring the
protobuf runtime (benchmarks/README.md).

Field numbers, from k8s.io/kubelet v0.37.2 pkg/apis/podresources/v1/api.proto:

    ListPodResourcesResponse { repeated PodResources pod_resources = 1; }
    GetPodResourcesRequest { string pod_name = 1; string pod_namespace = 2; }
    GetPodResourcesResponse { PodResources pod_resources = 1; }
    PodResources { string name = 1; string namespace = 2;
                   repeated ContainerResources containers = 3; ... }
    ContainerResources { string name = 1; repeated ContainerDevices devices = 2; ...
                         repeated DynamicResource dynamic_resources = 5; }
    ContainerDevices { string resource_name = 1; repeated string device_ids = 2; ... }
    DynamicResource { string claim_name = 2; string claim_namespace = 3;
                      repeated ClaimResource claim_resources = 4; }   (1: a removed class name)
    ClaimResource { repeated CDIDevice cdi_devices = 1; string driver_name = 2;
                    string pool_name = 3; string device_name = 4; optional string share_id = 5; }
    CDIDevice { string name = 1; }
    AllocatableResourcesResponse { repeated ContainerDevices devices = 1; ... }
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

VARINT, FIXED64, LENGTH, START_GROUP, END_GROUP, FIXED32 = 0, 1, 2, 3, 4, 5


class WireError(ValueError):
    """The bytes are not a valid encoding of the message."""


@dataclass(frozen=True)
class ContainerDevices:
    resource_name: str = ""
    device_ids: tuple[str, ...] = ()


@dataclass(frozen=True)
class ClaimResource:
    """One device a DRA driver prepared, and the CDI devices (`vendor/class=name`) it names
    for the container runtime."""

    driver_name: str = ""
    pool_name: str = ""
    device_name: str = ""
    cdi_devices: tuple[str, ...] = ()
    share_id: str | None = None


@dataclass(frozen=True)
class DynamicResource:
    """One ResourceClaim of the container, with the devices its drivers prepared."""

    claim_name: str = ""
    claim_namespace: str = ""
    claim_resources: tuple[ClaimResource, ...] = ()


@dataclass(frozen=True)
class ContainerResources:
    name: str = ""
    devices: tuple[ContainerDevices, ...] = ()
    dynamic_resources: tuple[DynamicResource, ...] = ()


@dataclass(frozen=True)
class PodResources:
    name: str = ""
    namespace: str = ""
    containers: tuple[ContainerResources, ...] = field(default_factory=tuple)


def _varint(data: memoryview, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if at >= len(data):
            raise WireError("truncated varint")
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, at
        shift += 7
        if shift >= 64:
            raise WireError("varint longer than 10 bytes")


def fields(data: memoryview) -> Iterator[tuple[int, int, memoryview | int]]:
    """(field number, wire type, value) for each field: a view for length-delimited fields,
    the integer for varints; fixed-width fields are returned as their raw integer."""
    at = 0
    while at < len(data):
        key, at = _varint(data, at)
        number, kind = key >> 3, key & 7
        if number == 0:
            raise WireError("field number 0")
        if kind == VARINT:
            value, at = _varint(data, at)
            yield number, kind, value
        elif kind == LENGTH:
            size, at = _varint(data, at)
            if at + size > len(data):
                raise WireError(f"field {number} runs past the end of its message")
            yield number, kind, data[at : at + size]
            at += size
        elif kind in (FIXED64, FIXED32):
            width = 8 if kind == FIXED64 else 4
            if at + width > len(data):
                raise WireError(f"field {number} runs past the end of its message")
            yield number, kind, int.from_bytes(data[at : at + width], "little")
            at += width
        else:  # groups are not used by proto3 and not by this API
            raise WireError(f"unsupported wire type {kind} (field {number})")


def _text(value: memoryview | int, what: str) -> str:
    if isinstance(value, int):
        raise WireError(f"{what} is not length-delimited")
    try:
        return bytes(value).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise WireError(f"{what} is not UTF-8") from exc


def _message(value: memoryview | int, what: str) -> memoryview:
    if isinstance(value, int):
        raise WireError(f"{what} is not length-delimited")
    return value


def _devices(data: memoryview) -> ContainerDevices:
    resource, ids = "", []
    for number, _, value in fields(data):
        if number == 1:
            resource = _text(value, "resource_name")
        elif number == 2:
            ids.append(_text(value, "device_ids"))
    return ContainerDevices(resource, tuple(ids))


def _cdi_device(data: memoryview) -> str:
    name = ""
    for number, _, value in fields(data):
        if number == 1:
            name = _text(value, "CDI device name")
    return name


def _claim_resource(data: memoryview) -> ClaimResource:
    driver = pool = device = ""
    share: str | None = None
    cdi: list[str] = []
    for number, _, value in fields(data):
        if number == 1:
            cdi.append(_cdi_device(_message(value, "cdi_devices")))
        elif number == 2:
            driver = _text(value, "driver_name")
        elif number == 3:
            pool = _text(value, "pool_name")
        elif number == 4:
            device = _text(value, "device_name")
        elif number == 5:
            share = _text(value, "share_id")
    return ClaimResource(driver, pool, device, tuple(cdi), share)


def _dynamic(data: memoryview) -> DynamicResource:
    claim = namespace = ""
    resources: list[ClaimResource] = []
    for number, _, value in fields(data):
        if number == 2:
            claim = _text(value, "claim_name")
        elif number == 3:
            namespace = _text(value, "claim_namespace")
        elif number == 4:
            resources.append(_claim_resource(_message(value, "claim_resources")))
    return DynamicResource(claim, namespace, tuple(resources))


def _container(data: memoryview) -> ContainerResources:
    name, devices, dynamic = "", [], []
    for number, _, value in fields(data):
        if number == 1:
            name = _text(value, "container name")
        elif number == 2:
            devices.append(_devices(_message(value, "devices")))
        elif number == 5:
            dynamic.append(_dynamic(_message(value, "dynamic_resources")))
    return ContainerResources(name, tuple(devices), tuple(dynamic))


def _pod(data: memoryview) -> PodResources:
    name, namespace, containers = "", "", []
    for number, _, value in fields(data):
        if number == 1:
            name = _text(value, "pod name")
        elif number == 2:
            namespace = _text(value, "pod namespace")
        elif number == 3:
            containers.append(_container(_message(value, "containers")))
    return PodResources(name, namespace, tuple(containers))


def list_response(data: bytes) -> list[PodResources]:
    """The pods of a ListPodResourcesResponse."""
    view = memoryview(data)
    return [_pod(_message(v, "pod_resources")) for n, _, v in fields(view) if n == 1]


def get_response(data: bytes) -> PodResources | None:
    """The pod of a GetPodResourcesResponse (None when the answer holds none)."""
    view = memoryview(data)
    found = None
    for number, _, value in fields(view):
        if number == 1:  # a message field given twice is merged; the kubelet sends it once
            found = _pod(_message(value, "pod_resources"))
    return found


def key(number: int, kind: int) -> bytes:
    """A field's tag: its number and wire type."""
    return encoded_varint(number << 3 | kind)


def encoded_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def message_field(number: int, payload: bytes) -> bytes:
    """A length-delimited field holding `payload` (an encoded message, or bytes)."""
    return key(number, LENGTH) + encoded_varint(len(payload)) + payload


def string_field(number: int, text: str) -> bytes:
    """A proto3 string field; the empty string is the default, which proto3 does not send."""
    if not text:
        return b""
    raw = text.encode("utf-8")
    return message_field(number, raw)


def get_request(name: str, namespace: str) -> bytes:
    """A GetPodResourcesRequest for the pod `namespace`/`name`."""
    return string_field(1, name) + string_field(2, namespace)


def allocatable_response(data: bytes) -> list[ContainerDevices]:
    """The devices of an AllocatableResourcesResponse: every device the device plugins
    advertise to the kubelet, by resource."""
    view = memoryview(data)
    return [_devices(_message(v, "devices")) for n, _, v in fields(view) if n == 1]
