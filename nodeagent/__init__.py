"""The gpuusage node agent (installed as gpuusage.nodeagent)."""
