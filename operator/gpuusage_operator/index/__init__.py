"""The pod and DRA indexes the watches keep: a few fields per pod, keyed by container ID and
pod UID (packed for the pods that never touch a GPU), and which devices a DRA claim got."""
