"""The controller loop: one work queue of report names with deadlines and retries, the
workers that take them, the reconcile of one report (judge, then write, then policies), the
limits on how often, and the housekeeping a clock drives."""
