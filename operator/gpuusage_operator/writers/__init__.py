"""The writers: the only code that writes pods (annotations, the GPUInUse condition), report
statuses and Events, each writing only what changed and remembering what it wrote."""
