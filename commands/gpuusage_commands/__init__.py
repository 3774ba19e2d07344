"""The commands people run against a cluster (besides the agent and the operator)."""
