"""The project's exception root.

Errors a user can act on (a missing tool, a bad flag, an unreachable API) derive from
GpuusageError; the CLI prints their message as one line instead of a traceback.
"""


class GpuusageError(Exception):
    """An error with a message written for the person running the command."""
