"""High availability: which replica writes, by kopf's peering (the pure rule in `peering`,
the edge that follows it in `leader`)."""
