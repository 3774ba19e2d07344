"""High availability: which replica writes, by leader election over a Lease (the pure rule in
`election`, the elector and the gate in `leader`, the check before every write in `fence`)."""
