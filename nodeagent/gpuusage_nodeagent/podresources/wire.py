"""Decode the kubelet's `v1.ListPodResourcesResponse` from protobuf bytes. Pure.

Only the fields gpuusage reads are decoded (pod name and namespace, each container's devices);
every other field, known or added by a later kubelet, is skipped by its wire type, as protobuf
requires of any reader. A hand-written reader of six small messages costs the agent nothing to
import, where a generated module would bring the protobuf runtime (benchmarks/README.md).

Field numbers, from k8s.io/kubelet pkg/apis/podresources/v1/api.proto:

    ListPodResourcesResponse { repeated PodResources pod_resources = 1; }
    PodResources { string name = 1; string namespace = 2;
                   repeated ContainerResources containers = 3; }
    ContainerResources { string name = 1; repeated ContainerDevices devices = 2; ... }
    ContainerDevices { string resource_name = 1; repeated string device_ids = 2; ... }
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
class ContainerResources:
    name: str = ""
    devices: tuple[ContainerDevices, ...] = ()


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


def _container(data: memoryview) -> ContainerResources:
    name, devices = "", []
    for number, _, value in fields(data):
        if number == 1:
            name = _text(value, "container name")
        elif number == 2:
            devices.append(_devices(_message(value, "devices")))
    return ContainerResources(name, tuple(devices))


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


def allocatable_response(data: bytes) -> list[ContainerDevices]:
    """The devices of an AllocatableResourcesResponse: every device the device plugins
    advertise to the kubelet, by resource."""
    view = memoryview(data)
    return [_devices(_message(v, "devices")) for n, _, v in fields(view) if n == 1]
