"""/proc/<pid>/cgroup → container ID and pod UID. Pure: text in, attribution out.

What makes this hard, and how each case is handled:

* Layouts. Kubelet names pod cgroups `pod<uid>` (cgroupfs driver) or
  `kubepods-<qos>-pod<uid with _>.slice` (systemd driver; no QoS part for Guaranteed pods).
  Runtimes name container cgroups `cri-containerd-<id>.scope`, `crio-<id>.scope`,
  `docker-<id>.scope` (systemd) or a bare `<id>` / `crio-<id>` (cgroupfs). So path components
  are matched one by one, never by fixed prefixes.
* Mismatched drivers. A runtime on the cgroupfs driver given the kubelet's systemd-style parent
  makes one literal component `<pod slice>:<prefix>:<id>` under its own service's cgroup
  (`/system.slice/containerd.service/kubepods-…-pod<uid>.slice:cri-containerd:<id>`): it is
  read as the pod component followed by `<prefix>-<id>`. CRI-O on the systemd driver given
  cgroupfs-style parents encoded each slice twice (`kubepods.slice-kubepods_burstable.slice-
  kubepods_burstable_pod<uid>.slice.slice`): underscores and repeated `.slice` are accepted.
* `crio-conmon-<id>` holds CRI-O's monitor process, not the container: never a container ID.
* Nesting (kind, k3d, docker-in-docker) and tenants: several 64-hex IDs and even several pod
  components can appear in one path. Attribution is anchored at the *first* pod component under
  the kubelet's cgroup root, and the container is the *first* container-like component below
  it: everything deeper is a sub-cgroup that container made itself, and belongs to it. A
  privileged process of pod A that creates `…/pod<A>/<cidA>/…/pod<B>/<cidB>` is still pod A's;
  taking the innermost pod would let it charge its use to pod B. The kubelet's root is known
  from the agent's own cgroup (see kubelet_roots): when the agent runs in a kubelet nested in
  an outer pod and sees the host's full paths, the outer part (`/kubepods/…/pod<outer>/<id>/
  kubelet/…`) is the root's prefix and is skipped, so the inner pod is found. Without a known
  root (the agent is no pod, or its own file names none) the path is read from its start.
  Without a pod component, the first container-like component is the host runtime's container.
* cgroup v1 has one line per hierarchy, which can disagree; v2 has one `0::` line; hybrid hosts
  have both. Every line is parsed and the most complete answer wins (pod and container, then
  container, then pod), ties going to the unified hierarchy, then memory, cpu, pids, systemd.
* A private cgroup namespace shows paths relative to the reader's root, with `..` components
  and possibly nothing left to see: `..` is skipped, and an empty answer is reported as such.
* Static pods are keyed by a 32-hex config hash instead of a UUID; that is not the API's pod UID,
  so only the container ID is reported for them.
* A file with no line of the kernel's form `<hierarchy>:<controllers>:/<path>` (empty, cut
  short, garbage) says nothing, not "host process": it raises UnparseableCgroup, and the agent
  reports the process as unresolved with that reason. Single lines of another form beside good
  ones are skipped.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

Runtime = Literal["containerd", "cri-o", "docker", "podman", "unknown"]

_HEX64 = r"[0-9a-f]{64}"
_CONTAINER = re.compile(
    rf"^(?:(?P<prefix>cri-containerd|crio|docker|libpod|cri-dockerd)-)?(?P<id>{_HEX64})(?:\.scope)?$"
)
_UUID_ANY_SEP = r"[0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12}"
# `pod<uid>` (cgroupfs) or `...kubepods[-qos]-pod<uid>.slice` (systemd, kind's kubelet- prefix;
# `_` and `.slice.slice` where a runtime encoded the slice twice).
_POD = re.compile(
    rf"^(?:.*kubepods(?:[-_][a-z]+)?[-_])?pod(?P<uid>{_UUID_ANY_SEP}|[0-9a-f]{{32}})(?:\.slice)*$"
)
_PREFIX_RUNTIME: dict[str | None, Runtime] = {
    "cri-containerd": "containerd",
    "crio": "cri-o",
    "docker": "docker",
    "cri-dockerd": "docker",
    "libpod": "podman",
    None: "unknown",
}
# Lower is preferred when lines disagree and are equally complete.
_CONTROLLER_RANK = {"": 0, "memory": 1, "cpu,cpuacct": 2, "cpu": 2, "pids": 3, "name=systemd": 4}


@dataclass(frozen=True)
class CgroupAttribution:
    """What a process's cgroup membership says about it."""

    container_id: str | None = None
    pod_uid: str | None = None
    runtime: Runtime | None = None

    @property
    def completeness(self) -> int:
        return (2 if self.container_id else 0) + (1 if self.pod_uid else 0)


NO_ATTRIBUTION = CgroupAttribution()

_LINE = re.compile(r"^[0-9]+:[^:]*:/")


class UnparseableCgroup(ValueError):
    """The text is not a /proc/<pid>/cgroup file: it names no cgroup at all."""


def _normalise_uid(raw: str) -> str | None:
    if len(raw) == 32:  # static pod config hash: not an API pod UID
        return None
    return raw.replace("_", "-")


def _components(path: str) -> list[str]:
    """The path's components, a `<slice>:<prefix>:<id>` one read as `<slice>`, `<prefix>-<id>`."""
    parts: list[str] = []
    for part in path.strip().split("/"):
        if not part or part in (".", ".."):
            continue
        pieces = part.split(":")
        if len(pieces) == 3 and all(pieces):
            parts += [pieces[0], f"{pieces[1]}-{pieces[2]}"]
        else:
            parts.append(part)
    return parts


Root = tuple[str, ...]
"""The components of the kubelet's cgroup root on one hierarchy, as the agent reads paths."""

Roots = dict[str, Root]
"""The kubelet's root per hierarchy (the controllers field of a /proc/<pid>/cgroup line)."""


def _pod_match(part: str) -> re.Match[str] | None:
    return _POD.match(part.lower())


def parse_path(path: str, root: Root = ()) -> CgroupAttribution:
    """Attribute one cgroup path (the third field of a /proc/<pid>/cgroup line). `root`: the
    kubelet's cgroup root on that hierarchy, skipped where the path starts with it."""
    parts = _components(path)
    if root and tuple(parts[: len(root)]) == root:
        parts = parts[len(root) :]
    pod_index = None
    pod_uid = None
    for index, part in enumerate(parts):
        match = _pod_match(part)
        if match:  # the first pod component: anything below belongs to it
            pod_index, pod_uid = index, _normalise_uid(match["uid"])
            break
    start = 0 if pod_index is None else pod_index + 1
    for part in parts[start:]:
        if part.startswith("crio-conmon-"):
            continue
        match = _CONTAINER.match(part.lower())
        if match:
            runtime = _PREFIX_RUNTIME[match["prefix"]]
            if runtime == "unknown" and pod_index is not None and "crio" in parts[pod_index]:
                runtime = "cri-o"
            return CgroupAttribution(match["id"], pod_uid, runtime)
    if pod_index is not None:
        return CgroupAttribution(None, pod_uid, None)
    return NO_ATTRIBUTION


def _lines(text: str) -> list[tuple[str, str]]:
    """(controllers, path) of each line of the kernel's form."""
    return [
        (controllers, path)
        for line in text.splitlines()
        if _LINE.match(line)
        for _, controllers, path in [line.split(":", 2)]
    ]


_QOS = ("burstable", "besteffort", "guaranteed")


def _kubelet_level(part: str) -> bool:
    """A component the kubelet makes above a pod: `kubepods…` or a cgroupfs QoS folder."""
    lowered = part.lower()
    return "kubepods" in lowered or lowered in _QOS


def kubelet_roots(own: str) -> Roots:
    """The kubelet's cgroup root per hierarchy, from the agent's own /proc/self/cgroup: the
    agent is a pod of the kubelet it reports for, so the path above its pod's `kubepods…`
    components is that kubelet's root (empty on a plain node; the outer pod's path when the
    kubelet runs nested in one). The agent's own pod is the last pod component of its path: no
    tenant can move the agent. Hierarchies whose line names no pod give no root."""
    roots: Roots = {}
    for controllers, path in _lines(own):
        parts = _components(path)
        pods = [i for i, part in enumerate(parts) if _pod_match(part)]
        if not pods:
            continue
        start = pods[-1]
        while start > 0 and _kubelet_level(parts[start - 1]):
            start -= 1
        roots[controllers] = tuple(parts[:start])
    return roots


def parse_cgroup_file(text: str, roots: Roots | None = None) -> CgroupAttribution:
    """Attribute a process from the whole content of its /proc/<pid>/cgroup file; `roots`
    from kubelet_roots (none known: every path is read from its start).

    Raises UnparseableCgroup when no line has the kernel's form.
    """
    best: tuple[int, int, CgroupAttribution] | None = None
    lines = _lines(text)
    if not lines:
        shown = text[:40].encode("unicode_escape").decode("ascii")
        raise UnparseableCgroup(f"no line of the form hierarchy:controllers:/path in {shown!r}")
    for controllers, path in lines:
        found = parse_path(path, (roots or {}).get(controllers, ()))
        if found.completeness == 0:
            continue
        rank = _CONTROLLER_RANK.get(controllers, 5)
        key = (-found.completeness, rank)
        if best is None or key < best[:2]:
            best = (key[0], key[1], found)
    return best[2] if best else NO_ATTRIBUTION
