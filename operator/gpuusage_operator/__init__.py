"""The gpuusage operator: resolves node reports to pods and writes what it found."""
