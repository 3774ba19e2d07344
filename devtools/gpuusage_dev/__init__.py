"""Development tools: the local control plane, the simulated node, the demo, rule rendering.

Not part of the agent or operator images.
"""
