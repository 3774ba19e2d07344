"""The pure judgements: from a report, the pods and the clock to the status the report should
show and what each pod should carry. No I/O, no clock of their own; `report` is the entry."""
