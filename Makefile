# Entry points for people and CI. Each target installs what it needs into .venv first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo demo-binaries test test-oldest test-compat test-release test-gpu check lint binaries crd monitoring chart plugin lock images release clean

# __init__.py holds the version, which the installed package's metadata repeats.
$(VENV)/.installed: pyproject.toml src/requirements.txt nodeagent/requirements.txt operator/requirements.txt src/gpuusage/__init__.py
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "gpuusage needs Python >= 3.11; set PYTHON=/path/to/python3.11+")'
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@# setuptools tells every editable install of several source roots to beware of folders
	@# named like its packages; none of ours is (the roots hold gpuusage*), so it is not shown.
	PYTHONWARNINGS='ignore:Editable installation' $(PY) -m pip install -q -e '.[dev]'
	@touch $@

# The control-plane binaries, the node's (kubelet, scheduler, controller manager) and the tools
# the tests and lint run (kube-state-metrics, promtool, prometheus, helm, krew, actionlint),
# built from Go modules once and cached outside the repository; and the distribution's packages
# a real local node runs on.
binaries: $(VENV)/.installed
	@bash devtools/install-node-packages.sh
	$(VENV)/bin/gpuusage local-cluster build --tools --node

# What the demo runs, and nothing the tests alone need (no kube-state-metrics, promtool,
# prometheus, helm).
demo-binaries: $(VENV)/.installed
	@bash devtools/install-node-packages.sh
	$(VENV)/bin/gpuusage local-cluster build --node

## The main job: the product on a local control plane (a real node where the machine can run
## one), no GPU or cluster needed.
demo: demo-binaries
	$(VENV)/bin/gpuusage demo

## The whole test suite against the real local control plane: TEST_WORKERS workers side by
## side, each with its own control plane; the tests of the machine's one node run one after
## another in one of them (the `node` marker; see docs/testing.md).
TEST_WORKERS ?= 4
test: binaries
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup

## CI's second run: the tests of install, allocation and DRA (the `compat` marker, no real
## node) against the oldest supported Kubernetes release, built once like the default.
test-oldest: binaries
	$(PY) -m gpuusage_dev.compat --oldest --no-node --workers $(TEST_WORKERS)

## The compatibility run: the tests of install, allocation, DRA and the real node on every
## supported Kubernetes release, one after another; it prints the table docs/development.md
## records.
test-compat: binaries
	$(PY) -m gpuusage_dev.compat --workers $(TEST_WORKERS)

## The release's proof at full length: the images built for every release platform (CI builds
## this machine's own), checked, run, and built again to the same digests; then the whole
## release published to a loopback registry, and its parent commit's install upgraded to it
## on the real node from there (tests/test_release_e2e.py).
test-release: binaries
	GPUUSAGE_RELEASE_PLATFORMS=all $(PY) -m pytest tests/test_release_images.py \
	  tests/test_release_e2e.py -p no:cacheprovider

## The inner loop: lint and the pure unit tests (no control plane, node, helm or command
## runs; well under a minute). `make test` is the whole suite, and what CI runs.
check: $(VENV)/.installed lint
	$(PY) -m pytest -q -m "not cluster and not slow and not gpu" -p no:cacheprovider

## The real-GPU suite (tests/gpu): CUDA tenants and the agent on the machine's real driver;
## every test skips, saying why, where no GPU is found. Root makes the cgroup tests run.
test-gpu: $(VENV)/.installed
	$(PY) -m pytest -m gpu tests/gpu -p no:cacheprovider

# The last step checks the hosted workflows with actionlint, built from its Go module on first
# use (seconds; cached with the other tools).
lint: $(VENV)/.installed
	$(VENV)/bin/ruff check src operator nodeagent commands devtools tests benchmarks
	$(VENV)/bin/ruff format --check src operator nodeagent commands devtools tests benchmarks
	$(VENV)/bin/mypy
	$(PY) -m gpuusage_dev.workflows

crd: $(VENV)/.installed
	$(VENV)/bin/gpuusage crd --output crds/gpuusage.io_gpunodeusages.yaml
	$(VENV)/bin/gpuusage crd --policy --output crds/gpuusage.io_gpuusagepolicies.yaml
	$(PY) -m gpuusage_dev.chart

# The PrometheusRule, rendered from the plain rules file, the Grafana dashboards, and the
# kube-state-metrics config's checksum on its Deployment.
monitoring: $(VENV)/.installed
	$(PY) -m gpuusage_dev.rules manifests/monitoring/gpuusage.rules.yaml > manifests/monitoring/prometheusrule.yaml
	$(PY) -m gpuusage_dev.dashboards manifests/monitoring/dashboards
	$(PY) -m gpuusage_dev.configstamp manifests/monitoring
	$(PY) -m gpuusage_dev.chart

# The Helm chart's copies of the CRDs and of the monitoring files (Helm reads only its folder).
chart: $(VENV)/.installed
	$(PY) -m gpuusage_dev.chart

# The kubectl plugin's archives for Krew (dist/) and its manifest (plugins/krew/gpuusage.yaml,
# which names their sha256): after changing src/gpuusage or commands/, as after the models.
plugin: $(VENV)/.installed
	$(PY) -m gpuusage_dev.krewplugin

# Each image's dependency lock (pinned, with wheel hashes) from its requirements files.
lock: $(VENV)/.installed
	$(PY) -m gpuusage_dev.lock

## A release (docs/development.md, "How a release is cut"): `make release VERSION=X.Y.Z
## [REGISTRY=host[:port]/path] [KEYLESS=1]`. First it refuses a VERSION other than
## gpuusage.__version__ (naming both), a place that names another version, or a CHANGELOG
## without the release's dated section, before anything is built. Then the images (as `make
## images`), the chart with them pinned by digest, the Krew archives and manifest, and
## SHA256SUMS into dist/ and, with REGISTRY, the images and the chart pushed, signed with cosign
## ($COSIGN_KEY, else a key pair made into dist/; KEYLESS=1: the hosted workflow's identity),
## the SBOMs and provenance attested, and every signature verified.
release: $(VENV)/.installed
	$(PY) -m gpuusage_dev.version --release "$(VERSION)"
	$(PY) -m gpuusage_dev.release --out dist --command "make release VERSION=$(VERSION)" \
	  $(if $(REGISTRY),--registry "$(REGISTRY)") $(if $(filter 1 true yes,$(KEYLESS)),--keyless)

## The release's images in dist/images: each product image for linux/amd64 and linux/arm64 as
## one OCI index (an OCI layout archive), its digests in digests.json; every compiled file is
## checked to be for its platform's CPU, and `python -m gpuusage --version` is run in each
## platform's root (arm64 under qemu; root only). The arm64 Debian base takes about 8 minutes
## under qemu the first time (docs/development.md, "The images").
images: $(VENV)/.installed
	$(PY) -m gpuusage_dev.release.images --out dist/images

clean:
	rm -rf $(VENV) build dist *.egg-info .mypy_cache .ruff_cache .pytest_cache .hypothesis
