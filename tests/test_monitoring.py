"""The shipped monitoring, exercised by the real tools.

kube-state-metrics (built from Go modules, run under the ServiceAccount token the shipped RBAC
grants) exports the shipped CustomResourceStateMetrics config while the operator reconciles a
scenario on the local control plane. The scrape is checked series by series, and the series
taken from it, a healthy scrape and a troubled one, become the input of a `promtool test
rules` run that proves each shipped alert fires on the trouble and resolves after it.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from prometheus_client.parser import text_string_to_metric_families

from gpuusage.api import names
from gpuusage_commands.bill import query as bill_query
from gpuusage_dev import configstamp
from gpuusage_dev.dashboards import DASHBOARDS
from gpuusage_dev.dashboards import render as render_dashboard
from gpuusage_dev.localcluster.cluster import LocalCluster, free_port
from gpuusage_dev.localcluster.tools import (
    KUBE_STATE_METRICS,
    PROMTOOL,
    ensure_tool,
)
from gpuusage_dev.rules import RulesError, render, rule_groups
from gpuusage_dev.simulation import create_allocated_claim, create_gpu_slice, ensure_namespace
from tests.conftest import GPU0, GPU1, Kubectl, WorldFactory, token_kubeconfig, wait_for
from tests.examples import empty_report
from tests.fakenvml import mig_uuid
from tests.worldview import create_policy, in_namespace

REPO = Path(__file__).resolve().parents[1]
MONITORING = REPO / "manifests" / "monitoring"
RULES = MONITORING / "gpuusage.rules.yaml"
NS = "gpuusage-system"
SA = "gpuusage-state-metrics"
ALERTS = (
    "GpuNodeReportStale",
    "GpuMemoryNearlyFull",
    "GpuProcessesNotVisible",
    "GpuMemoryHeldOutsidePods",
    "GpuUsedWithoutRequest",
    "GpuUsedOutsideAllocation",
    "GpuHeldIdle",
    "GpuRequestedButIdle",
    "GpuPolicyActed",
)
SHARE_ALERTS = ("GpuShareExceeded",)
"""Alerts on the compute share, proven apart (test_the_bill_of_compute_on_a_shared_gpu)."""
RECORDS = (
    "namespace:gpuusage_gpu_memory_used_mib:sum",
    "namespace:gpuusage_gpus_used:count",
    "namespace:gpuusage_mig_devices_used:count",
    "namespace:gpuusage_gpu_memory_used_mib_hours:sum1h",
    "namespace:gpuusage_gpu_hours_used:sum1h",
    "namespace:gpuusage_mig_device_hours_used:sum1h",
    "namespace:gpuusage_gpus_allocated:sum",
    "namespace:gpuusage_mig_devices_allocated:sum",
    "namespace:gpuusage_gpu_shares_allocated:sum",
    "namespace:gpuusage_gpu_hours_allocated:sum1h",
    "namespace:gpuusage_mig_device_hours_allocated:sum1h",
    "namespace:gpuusage_gpu_share_hours_allocated:sum1h",
    "namespace:gpuusage_gpus_computing:count",
    "namespace:gpuusage_gpu_hours_computing:sum1h",
    "namespace:gpuusage_gpu_held_efficiency:ratio1h",
    "namespace:gpuusage_gpu_computing_efficiency:ratio1h",
    "namespace_pod:gpuusage_gpu_compute_share:sum",
    "namespace:gpuusage_gpu_compute_share:sum",
    "namespace_pod:gpuusage_gpu_compute_hours:sum1h",
    "namespace:gpuusage_gpu_compute_hours:sum1h",
    "namespace:gpuusage_gpus_share_untold:count",
    "namespace:gpuusage_gpu_hours_share_untold:sum1h",
    "namespace_pod:gpuusage_gpus_used:count",
    "namespace_pod:gpuusage_gpus_computing:count",
    "namespace_pod:gpuusage_gpu_memory_used_mib:sum",
    "namespace_pod:gpuusage_gpus_allocated:sum",
    "namespace_pod:gpuusage_gpu_hours_used:sum1h",
    "namespace_pod:gpuusage_gpu_hours_computing:sum1h",
    "namespace_pod:gpuusage_gpu_memory_used_mib_hours:sum1h",
    "namespace_pod:gpuusage_gpu_hours_allocated:sum1h",
)

Sample = tuple[str, frozenset[tuple[str, str]]]

OUTSIDE = "gpuusage-test/outside"
"""A namespace label the kube-state-metrics test's operator leaves out of its scope."""


@pytest.fixture(scope="session")
def promtool() -> Path:
    return ensure_tool(PROMTOOL)


def _promtool(binary: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(binary), *args], capture_output=True, text=True, check=False)


# -- the rules as files ----------------------------------------------------------------------
def test_prometheus_rule_is_rendered_from_the_rules_file() -> None:
    assert render(RULES) == (MONITORING / "prometheusrule.yaml").read_text(), (
        "manifests/monitoring/prometheusrule.yaml is out of date: run `make monitoring`"
    )
    rules = [r for g in rule_groups(RULES.read_text()) for r in g["rules"]]
    assert [r["alert"] for r in rules if "alert" in r] == [*ALERTS, *SHARE_ALERTS]
    assert [r["record"] for r in rules if "record" in r] == list(RECORDS)


def test_dashboards_are_rendered_from_their_source() -> None:
    for dashboard in DASHBOARDS:
        path = MONITORING / "dashboards" / f"{dashboard.uid}.json"
        assert path.read_text() == render_dashboard(dashboard), (
            f"{path} is out of date: run `make monitoring`"
        )
    listed = yaml.safe_load((MONITORING / "kustomization.yaml").read_text())
    (generated,) = [g for g in listed["configMapGenerator"] if g["name"] == "gpuusage-dashboards"]
    assert generated["options"]["labels"] == {"grafana_dashboard": "1"}
    assert sorted(generated["files"]) == sorted(f"dashboards/{d.uid}.json" for d in DASHBOARDS)


def test_every_dashboard_asks_for_its_data_source_and_the_variables_it_uses() -> None:
    for dashboard in DASHBOARDS:
        board = json.loads((MONITORING / "dashboards" / f"{dashboard.uid}.json").read_text())
        variables = {v["name"]: v for v in board["templating"]["list"]}
        assert variables["datasource"]["type"] == "datasource"
        assert variables["datasource"]["query"] == "prometheus"
        targets = [t for p in board["panels"] for t in p["targets"]]
        assert targets
        for panel in board["panels"]:
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        for target in targets:
            assert target["datasource"]["uid"] == "${datasource}"
            used = set(re.findall(r"\$(\w+)", target["expr"])) - {"__range"}
            assert used <= set(variables), f"{board['uid']}: {target['expr']} uses {used}"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("groups: [", "not YAML"),
        ("rules: []", "non-empty `groups`"),
        ("groups: [{name: x}]", "groups[0] needs a name and rules"),
    ],
)
def test_a_broken_rules_file_is_named(text: str, message: str) -> None:
    with pytest.raises(RulesError, match=re.escape(message)):
        rule_groups(text, "broken.yaml")


def test_promtool_checks_the_rules(promtool: Path, tmp_path: Path) -> None:
    checked = _promtool(promtool, "check", "rules", str(RULES))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    rules = len(ALERTS) + len(SHARE_ALERTS) + len(RECORDS)
    assert f"SUCCESS: {rules} rules found" in checked.stdout
    # The same check rejects a broken expression, so its success above means something.
    broken = tmp_path / "broken.yaml"
    broken.write_text(RULES.read_text().replace("max by (node) (", "max by (node) ((", 1))
    assert _promtool(promtool, "check", "rules", str(broken)).returncode != 0


# -- kube-state-metrics on the local control plane -------------------------------------------
def _scrape(port: int) -> dict[Sample, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    found: dict[Sample, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return found


def _serving(port: int) -> bool:
    try:
        _scrape(port)
    except OSError:  # not listening yet
        return False
    return True


def _value(samples: Mapping[Sample, float], name: str, **labels: str) -> float | None:
    """The value of the one series of `name` that has these labels; None when there is none."""
    matching = [v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= ls]
    assert len(matching) <= 1, f"{name}{labels} matches {len(matching)} series"
    return matching[0] if matching else None


@contextmanager
def _state_metrics(
    cluster: LocalCluster, api: client.ApiClient, tmp_path: Path, config: Path
) -> Iterator[tuple[int, subprocess.Popen[bytes]]]:
    """kube-state-metrics with `config`, as the shipped ServiceAccount; its port and process."""
    core = client.CoreV1Api(api)
    try:
        ensure_namespace(core, NS)
    except ApiException as exc:
        if exc.status != 409:
            raise
    docs = list(yaml.safe_load_all((MONITORING / "kube-state-metrics.yaml").read_text()))
    access = [
        d for d in docs if d["kind"] in ("ServiceAccount", "ClusterRole", "ClusterRoleBinding")
    ]
    kubectl = Kubectl(cluster.binaries.kubectl, cluster.kubeconfig)
    kubectl.run("apply", "-f", "-", stdin=yaml.safe_dump_all(access))
    kubeconfig = token_kubeconfig(cluster, core, NS, SA, None, path=tmp_path / "ksm.kubeconfig")
    port = free_port()
    log = (tmp_path / "ksm.log").open("w")
    proc = subprocess.Popen(
        [
            str(ensure_tool(KUBE_STATE_METRICS)),
            f"--kubeconfig={kubeconfig}",
            "--custom-resource-state-only",
            f"--custom-resource-state-config-file={config}",
            "--host=127.0.0.1",
            f"--port={port}",
            "--telemetry-host=127.0.0.1",
            f"--telemetry-port={free_port()}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_for(lambda: _serving(port), what="kube-state-metrics to serve")
        yield port, proc
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
    output = (tmp_path / "ksm.log").read_text()
    assert "forbidden" not in output, f"kube-state-metrics was refused access:\n{output[-3000:]}"


@pytest.fixture
def state_metrics(cluster: LocalCluster, api: client.ApiClient, tmp_path: Path) -> Iterator[int]:
    """kube-state-metrics with the shipped config; its port."""
    with _state_metrics(cluster, api, tmp_path, MONITORING / "gpunodeusage-metrics.yaml") as run:
        yield run[0]


def _configmap_volume(folder: Path, name: str, text: str, version: int) -> Path:
    """Write `name` as the kubelet updates a ConfigMap volume: into a new timestamped folder,
    then one atomic rename of the `..data` link; `name` links through `..data`."""
    folder.mkdir(exist_ok=True)
    data = folder / f"..2026_11_24_{version}"
    data.mkdir()
    (data / name).write_text(text)
    link = folder / "..data_tmp"
    link.symlink_to(data.name)
    link.replace(folder / "..data")
    if not (folder / name).is_symlink():
        (folder / name).symlink_to(Path("..data") / name)
    return folder / name


def test_the_state_metrics_deployment_carries_its_configs_checksum() -> None:
    assert configstamp.stamped(MONITORING) == configstamp.checksum(MONITORING), (
        "run `make monitoring`"
    )


@pytest.mark.cluster
def test_an_edited_config_reaches_kube_state_metrics(
    cluster: LocalCluster, api: client.ApiClient, tmp_path: Path
) -> None:
    """The config's ConfigMap has a fixed name. Edited in place, the kubelet updates the volume
    (a new folder, one rename of `..data`); kube-state-metrics notices and exits (it cannot
    rebind its port to reload in place), and the kubelet starts it on the new config."""
    shipped = (MONITORING / "gpunodeusage-metrics.yaml").read_text()
    config = yaml.safe_load(shipped)
    (metric,) = [
        m
        for m in config["spec"]["resources"][0]["metrics"]
        if m["name"] == "node_observed_timestamp_seconds"
    ]
    metric["name"] = "node_observed_before_the_edit"
    volume, name = tmp_path / "config", "gpunodeusage-metrics.yaml"
    path = _configmap_volume(volume, name, yaml.safe_dump(config), 1)
    node = f"ksm-{uuid.uuid4().hex[:5]}"
    report = empty_report(node)
    custom = client.CustomObjectsApi(api)
    group = (names.GROUP, names.VERSION, names.PLURAL)
    custom.create_cluster_custom_object(*group, report)
    observed, before = (
        "gpuusage_node_observed_timestamp_seconds",
        "gpuusage_node_observed_before_the_edit",
    )
    try:
        with _state_metrics(cluster, api, tmp_path, path) as (port, proc):
            wait_for(lambda: _value(_scrape(port), before, node=node), what="the first config")
            assert _value(_scrape(port), observed, node=node) is None
            _configmap_volume(volume, name, shipped, 2)
            assert proc.wait(timeout=30) != 0, "it exits on the change"
        with _state_metrics(cluster, api, tmp_path, path) as (port, _):
            assert wait_for(
                lambda: _value(_scrape(port), observed, node=node), what="the new config in use"
            ) == pytest.approx(1795521600.0)
    finally:
        custom.delete_cluster_custom_object(*group, node)


def _gpu(
    index: int,
    uuid: str,
    used: int,
    processes: list[tuple[int, int]],
    sm: dict[int, int] | None = None,
) -> dict[str, Any]:
    """A GPU of the scenario; `sm`: the SM utilization of some pids (the others: not reported)."""
    listed: list[dict[str, Any]] = [{"pid": pid, "usedMemoryMiB": mib} for pid, mib in processes]
    for entry in listed:
        if entry["pid"] in (sm or {}):
            entry["smUtil"] = (sm or {})[entry["pid"]]
    return {
        "index": index,
        "uuid": uuid,
        "memoryTotalMiB": 81920,
        "memoryUsedMiB": used,
        "processes": listed,
    }


def _input_series(phases: list[tuple[Mapping[Sample, float], int]]) -> list[dict[str, str]]:
    """promtool's input series: each scrape for its minutes, one sample a minute; a series
    that ends gets a staleness marker, as Prometheus writes one, and `_` while it is absent."""
    series = []
    for key in sorted({k for samples, _ in phases for k in samples}):
        values: list[str] = []
        for samples, minutes in phases:
            value = samples.get(key)
            if value is not None:
                values += [repr(value)] * minutes
            else:
                ended = bool(values) and values[-1] not in ("_", "stale")
                values += (["stale"] if ended else []) + ["_"] * (minutes - ended)
        series.append({"series": _series_text(*key), "values": " ".join(values)})
    return series


def _showback_test(
    phases: list[tuple[Mapping[Sample, float], int]],
    expected: Mapping[tuple[str, ...], float | None],
    queries: Mapping[str, tuple[str, float]] | None = None,
) -> dict[str, Any]:
    """A promtool unit test of the recording rules on these phases (see _input_series), the
    expected values per (rule, namespace) or (rule, namespace, pod) at their end (None: no
    series); `queries`: more expressions, each with its one sample's labels and value."""
    end = sum(minutes for _, minutes in phases) - 1

    def selector(rule: str, namespace: str, pod: str | None = None) -> str:
        labels = f'namespace="{namespace}"' + (f',pod="{pod}"' if pod else "")
        return f"{rule}{{{labels}}}"

    tests = [
        {
            "expr": selector(*key),
            "eval_time": f"{end}m",
            "exp_samples": [] if value is None else [{"labels": selector(*key), "value": value}],
        }
        for key, value in expected.items()
    ] + [
        {
            "expr": expr,
            "eval_time": f"{end}m",
            "exp_samples": [{"labels": labels, "value": value}],
        }
        for expr, (labels, value) in (queries or {}).items()
    ]
    return {
        "rule_files": [str(RULES)],
        "evaluation_interval": "1m",
        "tests": [
            {"interval": "1m", "input_series": _input_series(phases), "promql_expr_test": tests}
        ],
    }


def _panel_rules(values: Mapping[str, Mapping[str, str]]) -> dict[str, Any]:
    """Each dashboard query, its variables filled, as an alert that fires when it returns no
    data (`absent`), and one control query that never has data."""
    rules = [{"alert": "NoDataControl", "expr": "absent(gpuusage_no_such_series)"}]
    for dashboard in DASHBOARDS:
        for p, panel in enumerate(dashboard.panels):
            for n, query in enumerate(panel.queries):
                expr = query.expr.replace("$__range", "1h")
                for name, value in values[dashboard.uid].items():
                    expr = expr.replace(f"${name}", value)
                assert "$" not in expr, expr
                name = f"NoData_{dashboard.uid.replace('-', '_')}_{p}_{n}"
                rules.append({"alert": name, "expr": f"absent({expr})"})
    return {"groups": [{"name": "panels", "rules": rules}]}


def _panel_test(panels: Path, phases: list[tuple[Mapping[Sample, float], int]]) -> dict[str, Any]:
    """promtool: at the end of the phases, no panel's NoData alert fires (the control does)."""
    names = [r["alert"] for r in yaml.safe_load(panels.read_text())["groups"][0]["rules"]]
    end = sum(minutes for _, minutes in phases) - 1
    checks = [
        {
            "eval_time": f"{end}m",
            "alertname": name,
            "exp_alerts": [{"exp_labels": {}}] if name == "NoDataControl" else [],
        }
        for name in names
    ]
    return {
        "rule_files": [str(RULES), str(panels)],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": _input_series(phases),
                "alert_rule_test": checks,
            }
        ],
    }


def _render(template: str, labels: Mapping[str, str]) -> str:
    """Prometheus' templating, for the only form the shipped annotations use: {{ $labels.x }}."""
    text = re.sub(r"\{\{\s*\$labels\.(\w+)\s*\}\}", lambda m: labels[m[1]], template)
    assert "{{" not in text, f"the test renders only {{{{ $labels.x }}}}; extend it for: {text}"
    return text


def _series_text(name: str, labels: frozenset[tuple[str, str]]) -> str:
    inner = ",".join(f'{k}="{v}"' for k, v in sorted(labels))
    return f"{name}{{{inner}}}"


def _promtool_test(
    healthy: Mapping[Sample, float],
    trouble: Mapping[Sample, float],
    expected: Mapping[str, list[dict[str, str]]],
) -> dict[str, Any]:
    """A promtool unit test: the healthy scrape for 20 minutes, the troubled one for 60, the
    healthy one again for 20 (see _input_series); alerts are checked before, during and after
    the trouble."""
    series = _input_series([(healthy, 20), (trouble, 60), (healthy, 20)])
    rules = {
        r["alert"]: r for g in rule_groups(RULES.read_text()) for r in g["rules"] if "alert" in r
    }

    def alerts(at: str, firing: bool) -> list[dict[str, Any]]:
        tests = []
        for alert in ALERTS:
            exp = []
            for labels in expected[alert] if firing else []:
                full = {**labels, **rules[alert]["labels"]}
                notes = {k: _render(v, full) for k, v in rules[alert]["annotations"].items()}
                exp.append({"exp_labels": full, "exp_annotations": notes})
            tests.append({"eval_time": at, "alertname": alert, "exp_alerts": exp})
        return tests

    return {
        "rule_files": [str(RULES)],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": series,
                # healthy; trouble too short for any `for:`; all five firing; resolved after.
                "alert_rule_test": [
                    *alerts("10m", False),
                    *alerts("23m", False),
                    *alerts("55m", True),
                    *alerts("95m", False),
                ],
            }
        ],
    }


@pytest.mark.cluster
def test_kube_state_metrics_series_and_the_alerts_they_fire(
    make_world: WorldFactory,
    state_metrics: int,
    promtool: Path,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:
    a = make_world(
        {"train": 1, "waiter": 1, "sneaky": 0, "stray": 0, "kernel": 1},
        idle_after=3.0,
        pod_extras={"stray": {"claims": {"gpu": "stray-gpu"}}},
        agent_extras={"idle_window": 0.5, "share_window": 10, "share_read_every": 0.25},
        # c's namespace is labelled outside the operator's scope below
        operator_extras={"policy_notice": 0.5, "namespace_selector": f"!{OUTSIDE}"},
    )
    # A policy tells the owner of a pod using a GPU it never requested (Notify, enforced).
    custom = client.CustomObjectsApi(a.api)
    policy = f"notify-{a.ns}"
    rule = {"finding": "UsingUnrequestedGPU", "after": "1s", "action": "Notify", "mode": "Enforce"}
    create_policy(a.api, policy, {"namespaceSelector": in_namespace(a.ns), "rules": [rule]})
    request.addfinalizer(
        lambda: custom.delete_cluster_custom_object(
            names.GROUP, names.VERSION, names.POLICY_PLURAL, policy
        )
    )
    b = make_world(  # reconciled by a's operator; slice asks for a MIG slice, frac has a share
        {"train": 1, "slice": 0, "frac": 0},
        operator=False,
        pod_extras={
            "slice": {"resources": {"nvidia.com/mig-1g.10gb": "1"}},
            "frac": {"annotations": {"gpu-fraction": "0.5"}},
        },
    )
    c = make_world({"train": 1}, operator=False)  # its one GPU turns blind in the trouble
    c.core.patch_namespace(c.ns, {"metadata": {"labels": {OUTSIDE: "true"}}})
    train, waiter, sneaky, stray, kernel = (
        a.pids[n] for n in ("train", "waiter", "sneaky", "stray", "kernel")
    )
    host = 777  # Xorg, outside any pod
    resource = client.ResourceV1Api(a.api)  # stray's claim got GPU0, where it runs at first
    create_gpu_slice(resource, a.node, [{"name": "gpu-0", "type": "gpu", "uuid": GPU0}])
    create_allocated_claim(resource, a.ns, "stray-gpu", a.node, ["gpu-0"])
    a.scenario(
        [
            _gpu(0, GPU0, 21504, [(train, 20480), (stray, 1024)], sm={train: 90}),
            _gpu(1, GPU1, 12288, [(waiter, 8192), (kernel, 4096)], sm={kernel: 40}),
        ]
    )
    # b's pods run on one MIG slice (the showback counts slices apart from whole GPUs)
    b.scenario(
        [
            {
                "index": 0,
                "uuid": GPU0,
                "memoryTotalMiB": 81920,
                "migDevices": [
                    {
                        "index": 0,
                        "uuid": mig_uuid(0),
                        "memoryTotalMiB": 40960,
                        "processes": [
                            {"pid": b.pids[name], "usedMemoryMiB": mib}
                            for name, mib in (("train", 10240), ("slice", 2048), ("frac", 1024))
                        ],
                    }
                ],
            }
        ]
    )
    c_gpu0 = [_gpu(0, GPU0, 4096, [(c.pids["train"], 4096)])]
    c.scenario(c_gpu0)
    ours = {a.node, b.node, c.node}

    def scrape() -> dict[Sample, float]:
        return {
            k: v
            for k, v in _scrape(state_metrics).items()
            if dict(k[1]).get("node") in ours or dict(k[1]).get("policy") == policy
        }

    def healthy_now() -> dict[Sample, float] | None:
        s = scrape()
        ok = (
            _value(s, "gpuusage_pod_gpu_memory_used_mib", node=a.node, pod="waiter") == 8192
            and _value(s, "gpuusage_pod_gpu_memory_used_mib", node=b.node, pod="frac") == 1024
            and _value(s, "gpuusage_pod_allocated_gpu_share", node=b.node, pod="frac") == 0.5
            and _value(s, "gpuusage_node_unattributed_processes", node=a.node) == 0
            and _value(s, "gpuusage_node_idle_pods", node=a.node) == 0
            and _value(s, "gpuusage_pod_gpu_memory_used_mib", node=c.node, pod="train") == 4096
            and _value(s, "gpuusage_pod_gpu_out_of_scope", node=c.node, pod="train") == 1
            and _value(s, "gpuusage_policy_actions_taken", policy=policy) == 0
            and _value(s, "gpuusage_pod_gpu_computing", node=a.node, pod="kernel") == 1
            and _value(s, "gpuusage_pod_gpu_computing", node=a.node, pod="train") == 1
            and _value(s, "gpuusage_pod_gpu_compute_share", node=a.node, pod="train") is not None
            and _value(s, "gpuusage_node_condition", node=b.node, condition="Stale", status="False")
            == 1
        )
        return s if ok else None

    healthy = wait_for(healthy_now, timeout=60, what="the healthy state in kube-state-metrics")
    node_a = {"node": a.node}
    assert _value(healthy, "gpuusage_node_gpus", **node_a) == 2
    assert _value(healthy, "gpuusage_node_pods", **node_a) == 4
    assert _value(healthy, "gpuusage_node_memory_used_mib", **node_a) == 33792
    assert _value(healthy, "gpuusage_node_memory_total_mib", **node_a) == 163840
    assert (
        _value(healthy, "gpuusage_node_condition", **node_a, condition="Ready", status="True") == 1
    )
    assert (
        _value(healthy, "gpuusage_gpu_memory_used_mib", **node_a, gpu=GPU0, gpu_index="0") == 21504
    )
    assert _value(healthy, "gpuusage_gpu_memory_total_mib", **node_a, gpu=GPU1) == 81920
    assert _value(healthy, "gpuusage_gpu_pods", **node_a, gpu=GPU1) == 2
    assert (
        _value(
            healthy,
            "gpuusage_pod_gpu_memory_used_mib",
            **node_a,
            namespace=a.ns,
            pod="train",
            uid=a.uids["train"],
            gpu=GPU0,
        )
        == 20480
    )
    assert _value(healthy, "gpuusage_pod_requested_gpus", **node_a, pod="train") == 1
    assert _value(healthy, "gpuusage_pod_gpu_unrequested", **node_a, pod="train") == 0
    assert _value(healthy, "gpuusage_pod_gpu_unrequested", **node_a, pod="stray") == 0
    assert _value(healthy, "gpuusage_pod_gpu_unallocated", **node_a, pod="stray") == 0
    assert _value(healthy, "gpuusage_pod_gpu_out_of_scope", **node_a, pod="train") == 0
    held = "gpuusage_pod_gpu_held_idle_since_timestamp_seconds"
    assert _value(healthy, held, **node_a, pod="kernel") == 0
    assert _value(healthy, "gpuusage_node_held_idle_pods", **node_a) == 0
    assert _value(healthy, "gpuusage_node_blind_devices", node=c.node) == 0
    # Computing is told only where the device tells: no series (never 0) for the waiter, whose
    # GPU reports no utilization for it, nor for b's pods on a MIG slice.
    assert _value(healthy, "gpuusage_pod_gpu_computing", **node_a, pod="waiter") is None
    assert _value(healthy, "gpuusage_pod_gpu_computing", node=b.node, pod="train") is None
    observed = _value(healthy, "gpuusage_node_observed_timestamp_seconds", **node_a)
    assert observed is not None
    assert abs(observed - time.time()) < 60

    # Trouble: GPU0 nearly full, a host process holds 4 GiB of GPU1 next to a pod that never
    # requested a GPU, the waiter's work ends (idle after 3 s), the kernel keeps its memory
    # and computes nothing (idle after 0.5 s, flagged 3 s later), and node b's agent dies.
    a.scenario(
        [
            _gpu(0, GPU0, 80896, [(train, 80896)], sm={train: 95}),
            _gpu(
                1,
                GPU1,
                11264,
                [(sneaky, 2048), (host, 4096), (stray, 1024), (kernel, 4096)],
                sm={kernel: 0},
            ),
        ]
    )
    b.agent.halt()
    # c's driver stops listing its trainer (a pid outside the agent's namespace) while the
    # memory stays: the device is blind, the trainer Unknown, never idle.
    c.scenario([{**c_gpu0[0], "processes": []}])

    def trouble_now() -> dict[Sample, float] | None:
        s = scrape()
        ok = (
            _value(s, "gpuusage_gpu_memory_used_mib", node=a.node, gpu=GPU0) == 80896
            and _value(s, "gpuusage_pod_gpu_unrequested", node=a.node, pod="sneaky") == 1
            and _value(s, "gpuusage_pod_gpu_unallocated", node=a.node, pod="stray") == 1
            and _value(s, "gpuusage_pod_requested_gpus_idle", node=a.node, pod="waiter") == 1
            and (_value(s, held, node=a.node, pod="kernel") or 0) > 0
            and _value(s, "gpuusage_pod_gpu_computing", node=a.node, pod="kernel") == 0
            and _value(s, "gpuusage_node_blind_devices", node=c.node) == 1
            and _value(s, "gpuusage_policy_actions_taken", policy=policy) == 1
            and _value(s, "gpuusage_node_condition", node=b.node, condition="Stale", status="True")
            == 1
        )
        return s if ok else None

    trouble = wait_for(trouble_now, timeout=60, what="the troubled state in kube-state-metrics")
    assert _value(trouble, "gpuusage_gpu_unattributed_memory_mib", **node_a, gpu=GPU1) == 4096
    assert _value(trouble, "gpuusage_gpu_unattributed_processes", **node_a, gpu=GPU1) == 1
    assert (
        _value(
            trouble,
            "gpuusage_unattributed_process_memory_mib",
            **node_a,
            gpu=GPU1,
            pid=str(host),
            reason="HostProcess",
            process="Xorg",
        )
        == 4096
    )
    assert _value(trouble, "gpuusage_node_unrequested_pods", **node_a) == 1
    assert _value(trouble, "gpuusage_node_orphaned_memory_mib", **node_a) == 4096  # Xorg
    assert _value(healthy, "gpuusage_node_orphaned_memory_mib", **node_a) is None
    orphaned_since = _value(trouble, "gpuusage_node_orphaned_since_timestamp_seconds", **node_a)
    assert orphaned_since is not None
    assert time.time() - 120 < orphaned_since <= time.time()
    assert _value(trouble, "gpuusage_policy_info", policy=policy, mode="Enforce") == 1
    assert _value(trouble, "gpuusage_node_unallocated_pods", **node_a) == 1
    assert _value(trouble, "gpuusage_node_idle_pods", **node_a) == 1
    assert _value(trouble, "gpuusage_node_idle_pods", node=c.node) == 0, "blind: not idle"
    assert _value(trouble, "gpuusage_node_held_idle_pods", **node_a) == 1
    held_since = _value(trouble, held, **node_a, pod="kernel")
    assert held_since is not None
    assert time.time() - 120 < held_since <= time.time()
    assert _value(trouble, "gpuusage_pod_requested_gpus", **node_a, pod="sneaky") == 0
    since = _value(trouble, "gpuusage_pod_gpu_idle_since_timestamp_seconds", **node_a, pod="waiter")
    assert since is not None
    assert since <= time.time()
    assert (
        _value(trouble, "gpuusage_node_condition", node=b.node, condition="Ready", status="False")
        == 1
    )

    # The alerts, on exactly these series.
    expected = {
        "GpuNodeReportStale": [{"node": b.node}],
        "GpuMemoryNearlyFull": [{"node": a.node, "gpu": GPU0}],
        "GpuProcessesNotVisible": [{"node": c.node}],
        "GpuMemoryHeldOutsidePods": [{"node": a.node, "gpu": GPU1}],
        "GpuUsedWithoutRequest": [{"namespace": a.ns, "pod": "sneaky", "node": a.node}],
        "GpuUsedOutsideAllocation": [{"namespace": a.ns, "pod": "stray", "node": a.node}],
        "GpuHeldIdle": [{"namespace": a.ns, "pod": "kernel", "node": a.node}],
        "GpuRequestedButIdle": [{"namespace": a.ns, "pod": "waiter", "node": a.node}],
        "GpuPolicyActed": [{"policy": policy}],
    }
    test_file = tmp_path / "alerts_test.yaml"
    test_file.write_text(yaml.safe_dump(_promtool_test(healthy, trouble, expected)))
    result = _promtool(promtool, "test", "rules", str(test_file))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout
    # Without the trouble nothing fires, so the same expectations must fail.
    calm = tmp_path / "calm_test.yaml"
    calm.write_text(yaml.safe_dump(_promtool_test(healthy, healthy, expected)))
    failed = _promtool(promtool, "test", "rules", str(calm))
    assert failed.returncode != 0
    for alert in ALERTS:
        assert f"alertname: {alert}" in failed.stdout + failed.stderr

    # Showback: 30 minutes healthy, then 30 in trouble (node b stale), evaluated at their end.
    # Used: a's pods use both GPUs throughout, 33,792 MiB then 88,064; b's three pods one MIG
    # slice with 13,312 MiB, counted only while b's report is fresh. Handed (from the pods,
    # also while b is stale): a's train, waiter and kernel 1 GPU each and stray's claim one
    # more; b's train 1 GPU, slice 1 MIG slice, frac half a GPU.
    hours = {
        ("namespace:gpuusage_gpu_hours_used:sum1h", a.ns): 2.0,
        ("namespace:gpuusage_gpu_memory_used_mib_hours:sum1h", a.ns): (33792 + 88064) / 2,
        ("namespace:gpuusage_mig_device_hours_used:sum1h", b.ns): 0.5,
        ("namespace:gpuusage_gpu_memory_used_mib_hours:sum1h", b.ns): 13312 / 2,
        ("namespace:gpuusage_gpu_hours_used:sum1h", b.ns): None,  # no whole GPU
        ("namespace:gpuusage_mig_device_hours_used:sum1h", a.ns): None,
        ("namespace:gpuusage_gpu_hours_allocated:sum1h", a.ns): 4.0,
        ("namespace:gpuusage_gpu_hours_allocated:sum1h", b.ns): 1.0,
        ("namespace:gpuusage_mig_device_hours_allocated:sum1h", b.ns): 1.0,
        ("namespace:gpuusage_mig_device_hours_allocated:sum1h", a.ns): 0.0,
        ("namespace:gpuusage_gpu_share_hours_allocated:sum1h", b.ns): 0.5,
        ("namespace:gpuusage_gpu_share_hours_allocated:sum1h", a.ns): None,  # no share
        # The bill of use. Computing: both GPUs while healthy (train, kernel), GPU0 alone in
        # the trouble (the kernel idles); nothing on b's MIG slice, whose activity is untold.
        ("namespace:gpuusage_gpu_hours_computing:sum1h", a.ns): 1.5,
        ("namespace:gpuusage_gpu_hours_computing:sum1h", b.ns): None,
        ("namespace:gpuusage_gpu_held_efficiency:ratio1h", a.ns): 2.0 / 4.0,
        ("namespace:gpuusage_gpu_computing_efficiency:ratio1h", a.ns): 1.5 / 4.0,
        ("namespace:gpuusage_gpu_held_efficiency:ratio1h", b.ns): None,  # no whole GPU used
        # per pod
        ("namespace_pod:gpuusage_gpu_hours_allocated:sum1h", a.ns, "train"): 1.0,
        ("namespace_pod:gpuusage_gpu_hours_used:sum1h", a.ns, "train"): 1.0,
        ("namespace_pod:gpuusage_gpu_hours_computing:sum1h", a.ns, "train"): 1.0,
        ("namespace_pod:gpuusage_gpu_memory_used_mib_hours:sum1h", a.ns, "train"): (20480 + 80896)
        / 2,
        ("namespace_pod:gpuusage_gpu_hours_computing:sum1h", a.ns, "kernel"): 0.5,
        ("namespace_pod:gpuusage_gpu_hours_used:sum1h", a.ns, "kernel"): 1.0,
        ("namespace_pod:gpuusage_gpu_hours_used:sum1h", a.ns, "sneaky"): 0.5,
        ("namespace_pod:gpuusage_gpu_hours_allocated:sum1h", a.ns, "sneaky"): None,
        ("namespace_pod:gpuusage_gpu_hours_computing:sum1h", a.ns, "waiter"): None,
        ("namespace_pod:gpuusage_gpu_hours_allocated:sum1h", b.ns, "train"): 1.0,
    }
    # `gpuusage top --by namespace --window 1h` asks Prometheus exactly these.
    ns_a = f'{{namespace="{a.ns}"}}'
    bill = {
        bill_query("handed", "1h", a.ns): (ns_a, 4.0),
        bill_query("held", "1h", a.ns): (ns_a, 2.0),
        bill_query("computing", "1h", a.ns): (ns_a, 1.5),
        bill_query("memory", "1h", a.ns): (ns_a, (33792 + 88064) / 2 / 1024),
    }
    showback = tmp_path / "showback_test.yaml"
    showback.write_text(yaml.safe_dump(_showback_test([(healthy, 30), (trouble, 30)], hours, bill)))
    result = _promtool(promtool, "test", "rules", str(showback))
    assert result.returncode == 0, result.stdout + result.stderr
    # Had b stayed fresh, its hours would differ: the same expectations must fail.
    fresh = tmp_path / "fresh_test.yaml"
    fresh.write_text(yaml.safe_dump(_showback_test([(healthy, 60)], hours)))
    assert _promtool(promtool, "test", "rules", str(fresh)).returncode != 0

    # Every dashboard query returns data on the healthy scrape, its variables set as a person
    # would pick them (node a; namespaces a and b; pod train of a).
    values = {
        "gpuusage-overview": {},
        "gpuusage-node": {"node": a.node},
        "gpuusage-namespace": {"namespace": f"{a.ns}|{b.ns}"},
        "gpuusage-pod": {"namespace": a.ns, "pod": "train"},
    }
    panels = tmp_path / "panels.yaml"
    panels.write_text(yaml.safe_dump(_panel_rules(values)))
    data = tmp_path / "panels_test.yaml"
    data.write_text(yaml.safe_dump(_panel_test(panels, [(healthy, 120)])))
    result = _promtool(promtool, "test", "rules", str(data))
    assert result.returncode == 0, result.stdout + result.stderr
    # With no series at all every panel is empty, and the same test fails for each.
    empty = tmp_path / "empty_test.yaml"
    empty.write_text(yaml.safe_dump(_panel_test(panels, [({}, 120)])))
    failed = _promtool(promtool, "test", "rules", str(empty))
    assert failed.returncode != 0
    empty_panels = set(re.findall(r'alertname="(NoData_\w+)"', failed.stdout + failed.stderr))
    assert len(empty_panels) == len(
        [q for d in DASHBOARDS for p in d.panels for q in p.queries if "vector(0)" not in q.expr]
    ), "every query but those that default to 0"


def _hour_of(share: float | None) -> float:
    """An hour of one-minute samples of `share`, as the rules bill it: `sum_over_time` over
    the hour's 60 samples, added as Prometheus adds them (its compensated sum, kahanSumInc),
    divided by 60. Not `share` itself: that can differ from it in the last bit (0.806 billed
    0.8059999999999999), and promtool compares exactly."""
    total = compensation = 0.0
    for value in [share or 0.0] * 60:
        added = total + value
        if abs(total) >= abs(value):
            compensation += (total - added) + value
        else:
            compensation += (value - added) + total
        total = added
    return (total + compensation) / 60


@pytest.mark.cluster
def test_the_bill_of_compute_on_a_shared_gpu(
    make_world: WorldFactory, state_metrics: int, promtool: Path, tmp_path: Path
) -> None:
    """Four pods time-sliced on one GPU: a hog at work all the time, handed a quarter of the GPU
    by a gpu-fraction, and three at work a fifth of each second; a fifth pod is an MPS client,
    which tells no share. kube-state-metrics exports each measured share and the handed one; on
    those scraped series the rules bill the namespace the GPU's busy time, one compute hour an
    hour, where the computing GPU-hours of its pods add up to four; the MPS client's GPU-hour
    is counted apart; the hog, at more than twice its share for an hour, fires GpuShareExceeded,
    and nobody else does."""
    w = make_world(
        {"hog": 0, "a": 1, "b": 1, "c": 1, "mps": 1},
        pod_extras={"hog": {"annotations": {"gpu-fraction": "0.25"}}},
        agent_extras={"share_window": 10, "share_read_every": 0.25},
    )
    tenants: list[dict[str, Any]] = [
        {"pid": w.pids["hog"], "usedMemoryMiB": 8192, "smUtil": 90},
        *(
            {"pid": w.pids[name], "usedMemoryMiB": 1024, "smUtil": 90, "duty": 0.2}
            for name in ("a", "b", "c")
        ),
        {"pid": w.pids["mps"], "usedMemoryMiB": 1024, "types": ["compute", "mps"], "smUtil": 0},
    ]
    w.scenario([{**_gpu(0, GPU0, 20480, []), "processes": tenants}])
    sharing = ("hog", "a", "b", "c")

    def shared_now() -> dict[Sample, float] | None:
        s = {k: v for k, v in _scrape(state_metrics).items() if dict(k[1]).get("node") == w.node}
        told = [_value(s, "gpuusage_pod_gpu_compute_share", pod=pod) for pod in sharing]
        handed = _value(s, "gpuusage_pod_gpu_handed_share", pod="hog")
        return s if None not in told and handed == 0.25 else None

    scraped = wait_for(shared_now, timeout=60, what="the shares in kube-state-metrics")
    shares = {pod: _value(scraped, "gpuusage_pod_gpu_compute_share", pod=pod) for pod in sharing}
    assert _value(scraped, "gpuusage_pod_gpu_compute_share", pod="mps") is None, "an MPS client"
    assert _value(scraped, "gpuusage_pod_gpu_handed_share", pod="a") is None, "handed no share"
    # summed exactly rounded, as Prometheus' sum() (compensated) adds them
    total = math.fsum(v or 0.0 for v in shares.values())
    assert abs(total - 1.0) <= 0.05, f"the hog keeps the GPU busy: the shares add up to {total}"
    assert (shares["hog"] or 0) > 0.5, shares
    # The bill on exactly these series, 70 minutes of them.
    hours: dict[tuple[str, ...], float | None] = {
        ("namespace:gpuusage_gpu_compute_hours:sum1h", w.ns): _hour_of(total),
        **{
            ("namespace_pod:gpuusage_gpu_compute_hours:sum1h", w.ns, pod): _hour_of(shares[pod])
            for pod in sharing
        },
        **{("namespace_pod:gpuusage_gpu_hours_computing:sum1h", w.ns, pod): 1.0 for pod in sharing},
        ("namespace:gpuusage_gpu_hours_computing:sum1h", w.ns): 1.0,
        ("namespace:gpuusage_gpu_hours_share_untold:sum1h", w.ns): 1.0,
    }
    ns = f'{{namespace="{w.ns}"}}'
    bill = {
        bill_query("compute", "1h", w.ns): (ns, _hour_of(total)),
        bill_query("untold", "1h", w.ns): (ns, 1.0),
    }
    billed = tmp_path / "compute_test.yaml"
    billed.write_text(yaml.safe_dump(_showback_test([(scraped, 70)], hours, bill)))
    result = _promtool(promtool, "test", "rules", str(billed))
    assert result.returncode == 0, result.stdout + result.stderr
    # Billed per computing GPU-hour instead, the four pods would owe four: the same test fails.
    four = {**hours, ("namespace:gpuusage_gpu_compute_hours:sum1h", w.ns): 4.0}
    wrong = tmp_path / "four_test.yaml"
    wrong.write_text(yaml.safe_dump(_showback_test([(scraped, 70)], four)))
    assert _promtool(promtool, "test", "rules", str(wrong)).returncode != 0
    # The alert: the hog only, once its share has stood over twice its handed one for an hour.
    rule = next(
        r
        for g in rule_groups(RULES.read_text())
        for r in g["rules"]
        if r.get("alert") == "GpuShareExceeded"
    )
    labels = {
        "namespace": w.ns,
        "pod": "hog",
        "uid": w.uids["hog"],
        "node": w.node,
        "gpu": GPU0,
        **rule["labels"],
    }
    notes = {k: _render(v, labels) for k, v in rule["annotations"].items()}

    def at(minute: str, firing: bool) -> dict[str, Any]:
        exp = [{"exp_labels": labels, "exp_annotations": notes}] if firing else []
        return {"eval_time": minute, "alertname": "GpuShareExceeded", "exp_alerts": exp}

    alerts = tmp_path / "share_alert_test.yaml"
    alerts.write_text(
        yaml.safe_dump(
            {
                "rule_files": [str(RULES)],
                "evaluation_interval": "1m",
                "tests": [
                    {
                        "interval": "1m",
                        "input_series": _input_series([(scraped, 75)]),
                        "alert_rule_test": [at("30m", False), at("65m", True)],
                    }
                ],
            }
        )
    )
    result = _promtool(promtool, "test", "rules", str(alerts))
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.cluster
@pytest.mark.usefixtures("monitoring_kinds")
def test_the_monitoring_overlay_validates_against_the_real_crds(kubectl: Kubectl) -> None:
    """ServiceMonitor, PodMonitor and PrometheusRule against the Prometheus Operator's own CRD
    schemas, and everything else of the overlay, by a server-side dry run (in the namespace a
    real install would have created)."""
    namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}}
    kubectl.run("apply", "-f", "-", stdin=json.dumps(namespace))
    out = kubectl.run(
        "apply", "-k", str(REPO / "manifests" / "overlays" / "monitoring"), "--dry-run=server"
    )
    for created in (
        "servicemonitor.monitoring.coreos.com/gpuusage-state-metrics",
        "servicemonitor.monitoring.coreos.com/gpuusage-operator",
        "podmonitor.monitoring.coreos.com/gpuusage-agent",
        "prometheusrule.monitoring.coreos.com/gpuusage",
        "deployment.apps/gpuusage-state-metrics",
    ):
        assert created in out, out
    # The schema is enforced: a misspelt field is refused, not ignored.
    bad = (MONITORING / "monitors.yaml").read_text().replace("honorLabels", "honourLabels")
    refused = kubectl.run(
        "apply", "--dry-run=server", "--validate=strict", "-f", "-", stdin=bad, check=False
    )
    assert 'unknown field "spec.endpoints[0].honourLabels"' in refused, refused
