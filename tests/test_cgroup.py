"""The cgroup parser against a corpus of real layouts, plus fuzzing."""

from __future__ import annotations

import contextlib
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuusage.api.models import CONTAINER_ID_PATTERN, POD_UID_PATTERN
from gpuusage_nodeagent.cgroup import (
    CgroupAttribution,
    UnparseableCgroup,
    kubelet_roots,
    parse_cgroup_file,
    parse_path,
)

CORPUS: list[dict[str, Any]] = yaml.safe_load(
    (Path(__file__).parent / "data" / "cgroup_corpus.yaml").read_text()
)


@pytest.mark.parametrize("case", CORPUS, ids=[c["name"] for c in CORPUS])
def test_corpus(case: dict[str, Any]) -> None:
    found = parse_cgroup_file(case["cgroup"])
    assert found.container_id == case["container"]
    assert found.pod_uid == case["pod"]
    if "runtime" in case:
        assert found.runtime == case["runtime"]


def test_corpus_covers_the_layouts_the_issue_names() -> None:
    names = " ".join(c["name"] for c in CORPUS).lower()
    for needed in (
        "docker",
        "containerd",
        "cri-o",
        "cgroup v1",
        "cgroup v2",
        "hybrid",
        "systemd",
        "cgroupfs",
        "guaranteed",
        "burstable",
        "besteffort",
        "kind",
        "k3d",
        "sub-cgroup",
        "private cgroup namespace",
        "host process",
        "slice:prefix:id",
        "double-encoded",
    ):
        assert needed in names, needed


uuids = st.uuids().map(str)
hex64 = st.text("0123456789abcdef", min_size=64, max_size=64)
qos = st.sampled_from(["", "burstable", "besteffort"])


@st.composite
def layouts(draw: st.DrawFn) -> tuple[str, str, str]:
    """A random but valid kubelet layout, possibly nested, with sub-cgroups below it."""
    uid, cid, level = draw(uuids), draw(hex64), draw(qos)
    prefix = draw(st.sampled_from(["", "/docker/" + draw(hex64), "/kubelet.slice", "/../.."]))
    if draw(st.booleans()):  # systemd driver
        runtime = draw(st.sampled_from(["cri-containerd", "crio", "docker"]))
        qos_slice = f"kubepods-{level}.slice/" if level else ""
        pod = f"kubepods-{level}-pod" if level else "kubepods-pod"
        path = (
            f"{prefix}/kubepods.slice/{qos_slice}{pod}{uid.replace('-', '_')}.slice/"
            f"{runtime}-{cid}.scope"
        )
    else:  # cgroupfs driver
        runtime = draw(st.sampled_from(["", "crio-"]))
        qos_dir = f"{level}/" if level else ""
        path = f"{prefix}/kubepods/{qos_dir}pod{uid}/{runtime}{cid}"
    tail = draw(st.sampled_from(["", "/init.scope", "/docker/" + draw(hex64), "/a/b"]))
    version = draw(st.sampled_from(["0::", "11:memory:", "1:name=systemd:"]))
    return f"{version}{path}{tail}\n", cid, uid


@given(layouts())
@settings(max_examples=300)
def test_generated_layouts_are_attributed(layout: tuple[str, str, str]) -> None:
    text, cid, uid = layout
    found = parse_cgroup_file(text)
    assert (found.container_id, found.pod_uid) == (cid, uid)


@given(st.text(max_size=400))
@settings(max_examples=500)
def test_arbitrary_text_never_crashes_and_yields_valid_ids(text: str) -> None:
    """Either valid IDs (possibly none) or UnparseableCgroup, never anything else."""
    try:
        found = parse_cgroup_file(text)
    except UnparseableCgroup:
        return
    _assert_valid(found)


@given(
    st.lists(
        st.sampled_from(
            [
                "pod",
                "kubepods",
                "crio-conmon-",
                "-",
                "_",
                ".slice",
                ".scope",
                "/",
                ":",
                "0",
                "a" * 64,
                "1" * 32,
                "..",
                "\n",
                "12345678-1234-1234-1234-123456789abc",
            ]
        ),
        max_size=40,
    ).map("".join)
)
@settings(max_examples=500)
def test_near_miss_inputs_never_crash(text: str) -> None:
    with contextlib.suppress(UnparseableCgroup):
        _assert_valid(parse_cgroup_file(text))
    _assert_valid(parse_path(text))


@pytest.mark.parametrize("text", ["", "\n", "garbage", "\x00\x01\x02", "1:cpu", "x::/kubepods"])
def test_a_file_that_names_no_cgroup_is_unparseable_not_a_host_process(text: str) -> None:
    with pytest.raises(UnparseableCgroup, match="no line of the form"):
        parse_cgroup_file(text)
    # One bad line beside a good one is skipped.
    found = parse_cgroup_file(f"{text}\n0::/kubepods/pod{'1' * 8}-1111-1111-1111-{'1' * 12}\n")
    assert found.pod_uid is not None


def _assert_valid(found: CgroupAttribution) -> None:
    if found.container_id is not None:
        assert re.match(CONTAINER_ID_PATTERN, found.container_id)
    if found.pod_uid is not None:
        assert re.match(POD_UID_PATTERN, found.pod_uid)


OUTER = "pod5a5a5a5a-1111-4222-8333-444444444444"
INNER = "6b6b6b6b-1111-4222-8333-444444444444"
CID_A, CID_B, CID_AGENT = "1" * 64, "2" * 64, "3" * 64


def test_a_tenant_cannot_charge_its_use_to_a_pod_it_names_below_its_container() -> None:
    """Pod A's privileged process makes cgroups that name pod B: it stays pod A's (the first
    pod under the kubelet's root), container and all; the innermost pod would be B."""
    text = f"0::/kubepods/burstable/{OUTER}/{CID_A}/kubepods/pod{INNER}/{CID_B}\n"
    found = parse_cgroup_file(text)
    assert (found.container_id, found.pod_uid) == (CID_A, OUTER.removeprefix("pod"))


def test_a_kubelet_nested_in_an_outer_pod_is_read_below_its_root() -> None:
    """The agent of a kubelet running inside pod A (kind in a CI pod) sees the host's full
    paths: its own cgroup tells the kubelet's root, and pod B below it is found."""
    nested = f"/kubepods/burstable/{OUTER}/{CID_A}/kubelet"
    own = f"0::{nested}/kubepods/besteffort/pod{'7' * 8}-1111-4222-8333-444444444444/{CID_AGENT}\n"
    roots = kubelet_roots(own)
    assert roots == {"": ("kubepods", "burstable", OUTER, CID_A, "kubelet")}
    text = f"0::{nested}/kubepods/burstable/pod{INNER}/{CID_B}\n"
    found = parse_cgroup_file(text, roots)
    assert (found.container_id, found.pod_uid) == (CID_B, INNER)
    # The same path read by the outer node's agent (its root is the host's): pod A's.
    assert parse_cgroup_file(text, kubelet_roots(f"0::/kubepods/pod{INNER}/{CID_AGENT}\n")) == (
        parse_cgroup_file(text)
    )
    assert parse_cgroup_file(text).pod_uid == OUTER.removeprefix("pod")
    # Inside the nested kubelet, a tenant's own nesting is still its own.
    sneaky = f"0::{nested}/kubepods/pod{INNER}/{CID_B}/kubepods/{OUTER}/{CID_A}\n"
    assert parse_cgroup_file(sneaky, roots).pod_uid == INNER


def test_roots_per_hierarchy_and_without_a_pod() -> None:
    """cgroup v1 hierarchies each have their own root; a line without a pod gives none (the
    agent outside any pod reads every path from its start)."""
    own = (
        f"4:memory:/outer/kubepods.slice/kubepods-besteffort.slice/"
        f"kubepods-besteffort-pod{INNER.replace('-', '_')}.slice/cri-containerd-{CID_AGENT}.scope\n"
        "3:cpu:/user.slice\n"
        "0::/\n"
    )
    assert kubelet_roots(own) == {"memory": ("outer",)}
    assert kubelet_roots("0::/process_api/abc\n") == {}
    text = f"4:memory:/outer/kubepods.slice/kubepods-pod{INNER.replace('-', '_')}.slice/{CID_B}\n"
    assert parse_cgroup_file(text, kubelet_roots(own)).pod_uid == INNER


@given(layouts(), st.lists(st.sampled_from([OUTER, f"pod{INNER}", CID_B, "kubepods", "x"])))
@settings(max_examples=300)
def test_nothing_below_a_container_changes_whose_it_is(
    layout: tuple[str, str, str], below: list[str]
) -> None:
    """Whatever cgroups a container makes below itself (pod and container names included),
    its processes stay its own."""
    text, cid, uid = layout
    line = text.rstrip("\n")
    nested = "/".join([line, *below]) if below else line
    found = parse_cgroup_file(nested + "\n")
    assert (found.container_id, found.pod_uid) == (cid, uid)
