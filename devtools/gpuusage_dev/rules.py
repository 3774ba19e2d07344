"""The alert rules as a Prometheus Operator PrometheusRule, from the plain rules file.

The rules are kept once, as a plain Prometheus rules file (what `promtool` checks and tests and
what a Prometheus without the operator loads); the PrometheusRule in manifests/monitoring is
rendered from it (`make monitoring`), and a test fails when the two differ.

    python -m gpuusage_dev.rules manifests/monitoring/gpuusage.rules.yaml > .../prometheusrule.yaml
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import yaml

from gpuusage.errors import GpuusageError

HEADER = """\
# Generated from gpuusage.rules.yaml by `make monitoring`; edit that file, not this one.
# The same alert groups for the Prometheus Operator (monitoring.coreos.com/v1).
"""


class RulesError(GpuusageError):
    """The rules file is not a Prometheus rules file."""


def rule_groups(text: str, source: str = "rules file") -> list[dict[str, Any]]:
    """The `groups` of a Prometheus rules file, checked for the shape a PrometheusRule needs."""
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise RulesError(f"{source}: not YAML: {exc}") from exc
    groups = doc.get("groups") if isinstance(doc, dict) else None
    if not isinstance(groups, list) or not groups:
        raise RulesError(f"{source}: expected a mapping with a non-empty `groups` list")
    for i, group in enumerate(groups):
        if not isinstance(group, dict) or not group.get("name") or not group.get("rules"):
            raise RulesError(f"{source}: groups[{i}] needs a name and rules")
    return groups


def prometheus_rule(
    groups: list[dict[str, Any]], namespace: str = "gpuusage-system"
) -> dict[str, Any]:
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {
            "name": "gpuusage",
            "namespace": namespace,
            "labels": {
                "app.kubernetes.io/name": "gpuusage",
                "app.kubernetes.io/part-of": "gpuusage",
            },
        },
        "spec": {"groups": groups},
    }


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (PromQL expressions) as `|` blocks, as people write them."""


def _string(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _string)


def render(rules_file: Path) -> str:
    groups = rule_groups(rules_file.read_text(), str(rules_file))
    body = yaml.dump(prometheus_rule(groups), Dumper=_Dumper, sort_keys=False, width=1000)
    return HEADER + body


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m gpuusage_dev.rules RULES_FILE", file=sys.stderr)
        return 2
    try:
        sys.stdout.write(render(Path(args[0])))
    except (OSError, RulesError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
