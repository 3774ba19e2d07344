"""A replica that leads again does not trust what it read of a Node before: on the real
apiserver, with the real Node writer, another leader takes this replica's marks off a Node
while it stands by; leading again, it reads the Node anew and marks it again, where it would
otherwise have trusted its old view for minutes."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
from kubernetes import client

from gpuusage.api.models import OrphanedMemory
from gpuusage_operator.policies.nodemarks import NodeMarker
from gpuusage_operator.policies.noderule import NodeMarks
from gpuusage_operator.policies.noderun import NodeRunner
from tests.builders import (
    Clock,
    PolicyStatusApi,
    reconciler_on,
    tainting_runner,
)

pytestmark = pytest.mark.cluster


@pytest.fixture
def node(api: client.ApiClient) -> Iterator[str]:
    core = client.CoreV1Api(api)
    name = f"terms-{uuid.uuid4().hex[:6]}"
    core.create_node(client.V1Node(metadata=client.V1ObjectMeta(name=name)))
    yield name
    core.delete_node(name)


def test_a_replica_leading_again_reads_a_nodes_marks_anew(api: client.ApiClient, node: str) -> None:
    clock = Clock(datetime(2026, 11, 28, 12, tzinfo=UTC))
    runner = tainting_runner(PolicyStatusApi(), clock)
    nodes = NodeRunner(runner, record=lambda *a: None, marker=NodeMarker(api))
    reconciler = reconciler_on(api, nodes=nodes)
    orphaned = OrphanedMemory(memoryMiB=4096, processes=1, since=clock.now - timedelta(hours=1))
    other = NodeMarker(api)  # another replica's writer: the same API, another memory

    nodes.visit(node, orphaned, certain=True, now=clock.now)
    assert other.read(node) == NodeMarks(condition=True, tainted=True)
    # This replica stands by; the leader, which saw the memory freed, takes the marks off.
    clock.now += timedelta(seconds=30)
    assert other.write(node, NodeMarks(), "freed", clock.now).outcome == "Done"
    # The memory is held again, and this replica leads again.
    reconciler.turned_active()
    clock.now += timedelta(seconds=30)
    nodes.visit(node, orphaned, certain=True, now=clock.now)
    assert other.read(node) == NodeMarks(condition=True, tainted=True), "marked again at once"
