"""GpuUsagePolicies: which policy covers a pod, what its rule does next (pure), the hourly
limits, and the thin edges that carry the steps out against the API and the Node."""
