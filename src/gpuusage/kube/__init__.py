"""Thin edges to the Kubernetes API: configuration, CRD installation, errors."""
