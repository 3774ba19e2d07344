"""The gpuusage node agent: observes its node's GPUs and publishes the GpuNodeUsage."""
