# Entry points for people and CI. Each target installs what it needs into .venv first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test lint binaries crd monitoring clean

$(VENV)/.installed: pyproject.toml src/requirements.txt nodeagent/requirements.txt operator/requirements.txt
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "gpuusage needs Python >= 3.11; set PYTHON=/path/to/python3.11+")'
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@# setuptools tells every editable install of several source roots to beware of folders
	@# named like its packages; none of ours is (the roots hold gpuusage*), so it is not shown.
	PYTHONWARNINGS='ignore:Editable installation' $(PY) -m pip install -q -e '.[dev]'
	@touch $@

# The control-plane binaries and the monitoring tools (kube-state-metrics, promtool), built
# from Go modules once and cached outside the repository.
binaries: $(VENV)/.installed
	$(VENV)/bin/gpuusage local-cluster build --monitoring

## The main job: the product on a local control plane, no GPU or cluster needed.
demo: binaries
	$(VENV)/bin/gpuusage demo

## The whole test suite against the real local control plane.
test: binaries
	$(PY) -m pytest

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check src operator nodeagent commands devtools tests benchmarks
	$(VENV)/bin/ruff format --check src operator nodeagent commands devtools tests benchmarks
	$(VENV)/bin/mypy

crd: $(VENV)/.installed
	$(VENV)/bin/gpuusage crd --output crds/gpuusage.io_gpunodeusages.yaml
	$(VENV)/bin/gpuusage crd --peering --output crds/kopf.dev_clusterkopfpeerings.yaml

# The PrometheusRule, rendered from the plain rules file, and the Grafana dashboards.
monitoring: $(VENV)/.installed
	$(PY) -m gpuusage_dev.rules manifests/monitoring/gpuusage.rules.yaml > manifests/monitoring/prometheusrule.yaml
	$(PY) -m gpuusage_dev.dashboards manifests/monitoring/dashboards

clean:
	rm -rf $(VENV) build dist *.egg-info .mypy_cache .ruff_cache .pytest_cache .hypothesis
