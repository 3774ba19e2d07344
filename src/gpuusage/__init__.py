"""gpuusage: which pod uses which GPU, and how much memory."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("gpuusage")
except PackageNotFoundError:  # running from a source tree without an install
    __version__ = "0.0.0+source"
