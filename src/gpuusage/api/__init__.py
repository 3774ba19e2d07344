"""The GpuNodeUsage API: names, models and the CRD rendered from them."""
