"""Names fixed by the design contract.

Users, RBAC rules, kube-state-metrics configs and alert rules refer to these strings, so they
live in one place and everything else imports them.
"""

from __future__ import annotations

from typing import Final

GROUP: Final = "gpuusage.io"
VERSION: Final = "v1alpha1"
API_VERSION: Final = f"{GROUP}/{VERSION}"
KIND: Final = "GpuNodeUsage"
PLURAL: Final = "gpunodeusages"
SINGULAR: Final = "gpunodeusage"
SHORT_NAMES: Final = ("gnu",)
CATEGORIES: Final = ("gpuusage",)
CRD_NAME: Final = f"{PLURAL}.{GROUP}"

# Pod annotations and condition written by the operator.
ANNOTATION_GPUS: Final = f"{GROUP}/gpus"
ANNOTATION_GPU_MEMORY_MIB: Final = f"{GROUP}/gpu-memory-mib"
ANNOTATION_USAGE: Final = f"{GROUP}/usage"
POD_CONDITION_GPU_IN_USE: Final = f"{GROUP}/GPUInUse"

# GpuUsagePolicy: what to do about what gpuusage sees (cluster-scoped).
POLICY_KIND: Final = "GpuUsagePolicy"
POLICY_PLURAL: Final = "gpuusagepolicies"
POLICY_SINGULAR: Final = "gpuusagepolicy"
POLICY_SHORT_NAMES: Final = ("gup",)
POLICY_CRD_NAME: Final = f"{POLICY_PLURAL}.{GROUP}"
ANNOTATION_EXEMPT: Final = f"{GROUP}/exempt"
"""On a pod or its namespace, "true": no policy acts on it. Written by people, not by us."""
ANNOTATION_POLICY_ACTION: Final = f"{GROUP}/policy-action"
"""On a pod: what a policy will do about it and when (the operator's announcement)."""
OPERATOR_ANNOTATIONS: Final = (
    ANNOTATION_GPUS,
    ANNOTATION_GPU_MEMORY_MIB,
    ANNOTATION_USAGE,
    ANNOTATION_POLICY_ACTION,
)
"""The annotations the operator writes; a pod carrying one of them (or the condition) is
marked. Others of our group (gpuusage.io/exempt) are people's and mark nothing."""
NODE_CONDITION_ORPHANED: Final = f"{GROUP}/OrphanedGPUMemory"
"""The Node condition type and the NoSchedule taint key of the OrphanedGPUMemory node rule."""

# Conditions on GpuNodeUsage.status.
CONDITION_READY: Final = "Ready"
CONDITION_STALE: Final = "Stale"
STALE_REASON_LEASE: Final = "LeaseRenewed"
"""The Stale condition's reason while the operator judges the node by its agent's Lease: the
agent then refreshes an unchanged report only every --report-refresh (see the publisher)."""

LEADER_LEASE: Final = "gpuusage-operator"
"""The coordination.k8s.io Lease in the operator's namespace through which its replicas elect
the one that acts (unless --leader-elect-resource-name says otherwise)."""

LEASE_HOLDER_PREFIX = "gpuusage-agent/"
"""Every holderIdentity the node agent writes in its Lease starts so; the operator counts only
such Leases."""

# OpenReports (openreports.io/v1alpha1): the findings where policy tools read them.
OPENREPORTS_GROUP: Final = "openreports.io"
OPENREPORTS_VERSION: Final = "v1alpha1"
OPENREPORTS_REPORTS: Final = "reports"
OPENREPORTS_CLUSTER_REPORTS: Final = "clusterreports"
OPENREPORT_NAME: Final = "gpuusage"
"""The Report in each namespace with pod findings, holding them all."""
OPENREPORT_CLUSTER_NAME: Final = "gpuusage-nodes"
"""The ClusterReport holding the node findings."""
OPENREPORT_SOURCE: Final = "gpuusage"
"""The reports' and their results' `source`, by which Policy Reporter tells tools apart."""
MANAGED_BY_LABEL: Final = "app.kubernetes.io/managed-by"
MANAGED_BY: Final = "gpuusage"
"""The label value on every object the operator creates, so that it lists only its own."""
