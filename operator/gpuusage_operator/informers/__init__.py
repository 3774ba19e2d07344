"""The watches: list then watch each kind the operator reads (pods, DRA claims and slices, the
agents' Leases, policies and namespaces) into in-memory state, as client-go's informers do,
and whether the API answers at all. No report is judged here; a change only queues work."""
