"""Writes refused before they are sent unless this replica leads.

Every write of the operator (pod marks, Events, statuses, policy actions, OpenReports) goes
through one API client; its requests that change something ask the gate immediately before
they go out, so a replica that stopped leading in the middle of a reconcile (its renew
deadline passed while it was paused or cut off) sends nothing more, whichever writer was
about to. Reads go through unasked. What is left is the instant between the question and the
request leaving: a pause exactly there is covered only by the margin between the renew
deadline and the lease duration, as in client-go.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kubernetes import client

from gpuusage.kube.errors import NotLeading

WRITES = frozenset({"POST", "PUT", "PATCH", "DELETE"})


def fence_writes(api: client.ApiClient, may_write: Callable[[], bool]) -> None:
    """Make every write through `api` ask `may_write` first, and fail with NotLeading when
    the answer is no."""
    rest: Any = api.rest_client
    send = rest.request

    def request(*args: Any, **kwargs: Any) -> Any:
        method = str(args[0] if args else kwargs.get("method", "")).upper()
        if method in WRITES and not may_write():
            url = args[1] if len(args) > 1 else kwargs.get("url", "")
            raise NotLeading(f"{method} {url} not sent: this replica does not lead now")
        return send(*args, **kwargs)

    rest.request = request
