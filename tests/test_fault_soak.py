"""The fault soak's short form: two apiserver restarts with pods recreated under the same name
and use changing meanwhile; every mark must be true afterwards (benchmarks/fault_soak.py runs
the long form)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.fault_soak import run_soak
from gpuusage_dev.localcluster.cluster import LocalCluster

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def test_no_wrong_mark_and_no_crash_across_apiserver_restarts(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    figures = run_soak(cluster, rounds=2, seed=7, work=tmp_path, timeout=60.0)
    assert figures["crashed"] == []
    assert figures["wrong"] == []
    assert len(figures["converge_s"]) == 2
    assert figures["pods_recreated"] == 4
