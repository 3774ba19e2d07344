"""gpuusage: which pod uses which GPU, and how much memory.

This package is what every part shares: the resource's API (`api`), the clients (`kube`), the
settings machinery and the one `gpuusage` command. The images copy it beside their own part.
"""

__version__ = "0.1.0"
"""The one copy of the version: the SemVer X.Y.Z the next `make release` publishes. pyproject.toml
reads it, images that copy the sources (instead of installing a wheel) report it too, and every
other place that names it is made from it or checked against it (gpuusage_dev.version)."""
