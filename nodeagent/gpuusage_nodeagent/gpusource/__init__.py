"""Where GPU observations come from: NVML, a scenario file, or nothing."""
