"""gpuusage: which pod uses which GPU, and how much memory.

This package is what every part shares: the resource's API (`api`), the clients (`kube`), the
settings machinery and the one `gpuusage` command. The images copy it beside their own part.
"""

__version__ = "0.1.0.dev0"
"""The one copy of the version: pyproject.toml reads it, and images that copy the sources
(instead of installing a wheel) report it too."""
