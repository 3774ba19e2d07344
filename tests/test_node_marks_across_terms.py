"""A replica that leads again does not trust what it read of a Node before: on the real
apiserver, with the real Lease election and Node writer, another leader takes this replica's
marks off a Node while it stands by; leading again (a new term, its memories new), it reads
the Node anew and marks it again, where it would otherwise have trusted its old view for
minutes. And a Node whose report went while another replica led keeps no marks of ours: the
new leader lists it (NodeMarker.marked) and, the report absent, reads and clears it."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta

import pytest
from kubernetes import client

from gpuusage.api.models import OrphanedMemory
from gpuusage_operator.controller.term import Term, new_terms
from gpuusage_operator.ha.election import Election, Timing
from gpuusage_operator.ha.leader import LeaseElector, LeaseLock, steady
from gpuusage_operator.ha.terms import Terms
from gpuusage_operator.policies.nodemarks import NodeMarker
from gpuusage_operator.policies.noderule import NodeMarks
from gpuusage_operator.policies.noderun import NodeRunner
from tests.builders import (
    Clock,
    PolicyStatusApi,
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


def tainting_nodes(api: client.ApiClient, clock: Clock, terms: Terms[Term]) -> NodeRunner:
    """The node runner of an enforced Taint rule, on the apiserver, its memory the term's."""
    return NodeRunner(
        tainting_runner(PolicyStatusApi(), clock),
        record=lambda *a: None,
        marker=NodeMarker(api),
        memory=lambda: terms.current.nodes,
    )


def test_a_replica_leading_again_reads_a_nodes_marks_anew(api: client.ApiClient, node: str) -> None:
    clock = Clock(datetime(2026, 11, 28, 12, 0, 0, tzinfo=UTC))  # a whole second: see leader
    terms = new_terms()
    nodes = tainting_nodes(api, clock, terms)
    lease = f"terms-{uuid.uuid4().hex[:6]}"

    def elector(identity: str, begin: Callable[[], None] = lambda: None) -> LeaseElector:
        election = Election(identity, Timing(), steady, begin=begin)
        return LeaseElector(LeaseLock(api, "default", lease), election, clock=lambda: clock.now)

    me, other = elector("me", terms.begin), elector("other")
    orphaned = OrphanedMemory(memoryMiB=4096, processes=1, since=clock.now - timedelta(hours=1))
    theirs = NodeMarker(api)  # the other replica's writer: the same API, another memory

    assert me.try_once()
    nodes.visit(node, orphaned, certain=True, now=clock.now)
    assert theirs.read(node) == NodeMarks(condition=True, tainted=True)
    me.stop()  # this replica hands the Lease over and stands by
    assert other.try_once()
    assert other.election.leading()
    # The leader, which saw the memory freed, takes the marks off.
    clock.now += timedelta(seconds=30)
    assert theirs.write(node, NodeMarks(), "freed", clock.now).outcome == "Done"
    other.stop()
    # The memory is held again, and this replica leads again.
    assert me.try_once()
    assert me.election.term == 2
    clock.now += timedelta(seconds=30)
    nodes.visit(node, orphaned, certain=True, now=clock.now)
    assert theirs.read(node) == NodeMarks(condition=True, tainted=True), "marked again at once"


def test_a_node_whose_report_went_meanwhile_is_found_and_cleared_by_the_next_leader(
    api: client.ApiClient, node: str
) -> None:
    clock = Clock(datetime(2026, 11, 28, 12, 0, 0, tzinfo=UTC))
    terms = new_terms()
    nodes = tainting_nodes(api, clock, terms)
    orphaned = OrphanedMemory(memoryMiB=4096, processes=1, since=clock.now - timedelta(hours=1))
    nodes.visit(node, orphaned, certain=True, now=clock.now)
    lister = NodeMarker(api)
    found = lister.marked()
    assert isinstance(found, set)
    assert node in found
    # Another replica led when the report was deleted, and died before clearing the node;
    # this one leads again (a new term: it has not read the node in it).
    terms.begin()
    clock.now += timedelta(minutes=1)
    nodes.forget(node, clock.now)
    assert lister.read(node) == NodeMarks(), "read, found marked, cleared"
    found = lister.marked()
    assert isinstance(found, set)
    assert node not in found
