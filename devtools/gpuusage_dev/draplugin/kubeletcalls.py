"""The calls a kubelet makes on a DRA driver, made by hand: what tests use to prepare claims and
to go through the registration handshake where no kubelet runs.

Over the agent's one-call gRPC client (gpuusage_nodeagent.podresources.client) with the
messages encoded here. Field numbers, from k8s.io/kubelet v0.37.2:

    pluginregistration (pkg/apis/pluginregistration/v1/api.proto):
      PluginInfo { string type = 1; string name = 2; string endpoint = 3;
                   repeated string supported_versions = 4; }
      RegistrationStatus { bool plugin_registered = 1; string error = 2; }
    k8s.io.kubelet.pkg.apis.dra.v1 (pkg/apis/dra/v1/api.proto):
      NodePrepareResourcesRequest { repeated Claim claims = 1; }
      Claim { string namespace = 1; string uid = 2; string name = 3; }
      NodePrepareResourcesResponse { map<string, NodePrepareResourceResponse> claims = 1; }
      NodePrepareResourceResponse { repeated Device devices = 1; string error = 2; }
      Device { repeated string request_names = 1; string pool_name = 2; string device_name = 3;
               repeated string cdi_device_ids = 4; optional string share_id = 5; }
      NodeUnprepareResourcesResponse { map<string, NodeUnprepareResourceResponse> claims = 1; }
      NodeUnprepareResourceResponse { string error = 1; }
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from gpuusage_nodeagent.podresources.client import unary
from gpuusage_nodeagent.podresources.wire import (
    VARINT,
    encoded_varint,
    fields,
    key,
    message_field,
    string_field,
)

DRA = "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin"
REGISTRATION = "/pluginregistration.Registration"


@dataclass(frozen=True)
class Claim:
    namespace: str
    name: str
    uid: str


@dataclass(frozen=True)
class PluginInfo:
    type: str
    name: str
    endpoint: str
    supported_versions: tuple[str, ...]


@dataclass(frozen=True)
class PreparedDevice:
    request_names: tuple[str, ...]
    pool_name: str
    device_name: str
    cdi_device_ids: tuple[str, ...]
    share_id: str | None


@dataclass(frozen=True)
class PrepareResult:
    devices: tuple[PreparedDevice, ...]
    error: str


def _claims(claims: Iterable[Claim]) -> bytes:
    return b"".join(
        message_field(
            1, string_field(1, c.namespace) + string_field(2, c.uid) + string_field(3, c.name)
        )
        for c in claims
    )


def _str(value: memoryview | int) -> str:
    return bytes(value).decode() if isinstance(value, memoryview) else ""


def _map_entries(data: bytes) -> Iterable[tuple[str, memoryview]]:
    """The (key, value message) entries of a map<string, message> field 1."""
    for number, _, entry in fields(memoryview(data)):
        if number != 1 or not isinstance(entry, memoryview):
            continue
        key, value = "", memoryview(b"")
        for inner, _, part in fields(entry):
            if inner == 1:
                key = _str(part)
            elif inner == 2 and isinstance(part, memoryview):
                value = part
        yield key, value


def _device(data: memoryview) -> PreparedDevice:
    requests: list[str] = []
    cdi: list[str] = []
    pool = device = ""
    share: str | None = None
    for number, _, value in fields(data):
        if number == 1:
            requests.append(_str(value))
        elif number == 2:
            pool = _str(value)
        elif number == 3:
            device = _str(value)
        elif number == 4:
            cdi.append(_str(value))
        elif number == 5:
            share = _str(value)
    return PreparedDevice(tuple(requests), pool, device, tuple(cdi), share)


def prepare(
    socket: Path, claims: Iterable[Claim], timeout: float = 30.0
) -> dict[str, PrepareResult]:
    """NodePrepareResources for `claims`, as the kubelet calls it: claim UID → result."""
    answer = unary(socket, f"{DRA}/NodePrepareResources", _claims(claims), timeout)
    results = {}
    for uid, value in _map_entries(answer):
        devices, error = [], ""
        for number, _, part in fields(value):
            if number == 1 and isinstance(part, memoryview):
                devices.append(_device(part))
            elif number == 2:
                error = _str(part)
        results[uid] = PrepareResult(tuple(devices), error)
    return results


def unprepare(socket: Path, claims: Iterable[Claim], timeout: float = 30.0) -> dict[str, str]:
    """NodeUnprepareResources for `claims`: claim UID → error ("" when unprepared)."""
    answer = unary(socket, f"{DRA}/NodeUnprepareResources", _claims(claims), timeout)
    results = {}
    for uid, value in _map_entries(answer):
        results[uid] = next((_str(v) for n, _, v in fields(value) if n == 1), "")
    return results


def plugin_info(socket: Path, timeout: float = 10.0) -> PluginInfo:
    """GetInfo on a registration socket, as the kubelet's plugin watcher asks on finding it."""
    answer = unary(socket, f"{REGISTRATION}/GetInfo", b"", timeout)
    found: dict[int, list[str]] = {}
    for number, _, value in fields(memoryview(answer)):
        found.setdefault(number, []).append(_str(value))
    first = {n: values[0] for n, values in found.items()}
    return PluginInfo(first.get(1, ""), first.get(2, ""), first.get(3, ""), tuple(found.get(4, [])))


def notify_registered(socket: Path, error: str = "", timeout: float = 10.0) -> None:
    """NotifyRegistrationStatus as the kubelet sends it once it took the plugin (or, with
    `error`, refused it: the plugin then answers with an error, raised as CallError)."""
    registered = key(1, VARINT) + encoded_varint(0 if error else 1)
    unary(
        socket,
        f"{REGISTRATION}/NotifyRegistrationStatus",
        registered + string_field(2, error),
        timeout,
    )
