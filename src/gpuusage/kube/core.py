"""The requests the operator sends without the `kubernetes` package's generated API classes.

Two reasons. Memory: the client (37.x) builds a validator for each of `CoreV1Api`'s hundreds of
methods and imports the 250 models they name when the class is first imported: a large part of
the operator's resident memory, for the dozen requests below (benchmarks/README.md, "Operator:
memory at 5,000 reports"). Times: since 37.0 a generated method validates its body into a
model, and the model writes a datetime with `isoformat`, which leaves out the fraction of a time
on a whole second; a Lease's or an Event's MicroTime without its six digits is refused by the
apiserver (1 write in 10⁶ lost). Here a body goes out as the caller built it.

`CoreApi` (core/v1 pods, namespaces and nodes), `LeaseApi` (coordination.k8s.io/v1) and
`EventApi` (events.k8s.io/v1) send their requests as the generated classes do, through the same
`ApiClient` (its configuration, credentials, connection pool and fence), with the same method
names and the keyword arguments the operator passes; the answer is the raw response, as
`_preload_content=False` gives it (see raw), read by the caller or dropped. A status outside
2xx raises the client's ApiException, as the generated classes do. The client's ApiClient
changed its calls in 37.0; both it and the earlier one (the lowest supported, 36.0) are served.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

from kubernetes.client.exceptions import ApiException

QUERY = {
    "allow_watch_bookmarks": "allowWatchBookmarks",
    "_continue": "continue",
    "field_selector": "fieldSelector",
    "label_selector": "labelSelector",
    "limit": "limit",
    "resource_version": "resourceVersion",
    "timeout_seconds": "timeoutSeconds",
    "watch": "watch",
    "grace_period_seconds": "gracePeriodSeconds",
}
"""The query parameters a request may carry: the client's keyword → the API's name."""


class RawApi:
    """Requests sent as the generated API classes send them (see the module's docstring)."""

    def __init__(self, api_client: Any) -> None:
        self.api_client = api_client  # kubernetes.client.ApiClient

    def _send(self, method: str, path: str, options: dict[str, Any], body: Any = None) -> Any:
        """One request as the generated method sends it; the raw response (whatever
        `_preload_content` says: nothing here is read into a model)."""
        options = dict(options)
        content_type = options.pop("_content_type", None)
        timeout = options.pop("_request_timeout", None)
        options.pop("_preload_content", None)
        unknown = sorted(set(options) - set(QUERY))
        if unknown:
            raise TypeError(f"{method} {path}: no such argument: {', '.join(unknown)}")
        query = [(QUERY[k], v) for k, v in options.items() if v is not None]
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = content_type or _content_type(method, body)
        if not hasattr(self.api_client, "param_serialize"):
            # The client before 37.0 (generated otherwise): one call, which raises
            # ApiException itself and answers the unread urllib3 response.
            return self.api_client.call_api(
                path,
                method,
                query_params=query,
                header_params=headers,
                body=body,
                auth_settings=["BearerToken"],
                _return_http_data_only=True,
                _preload_content=False,
                _request_timeout=timeout,
            )
        request = self.api_client.param_serialize(
            method=method,
            resource_path=path,
            query_params=query,
            header_params=headers,
            body=body,
            auth_settings=["BearerToken"],
        )
        response = self.api_client.call_api(*request, _request_timeout=timeout)
        if not 200 <= response.status <= 299:
            response.read()
            raise ApiException.from_response(http_resp=response, body=None, data=None)
        return response.response


class CoreApi(RawApi):
    """The pods, namespaces and nodes of core/v1 that the operator reads and writes."""

    def list_pod_for_all_namespaces(self, **kwargs: Any) -> Any:
        return self._send("GET", "/api/v1/pods", kwargs)

    def list_namespaced_pod(self, namespace: str, **kwargs: Any) -> Any:
        return self._send("GET", f"/api/v1/namespaces/{_part(namespace)}/pods", kwargs)

    def read_namespaced_pod(self, name: str, namespace: str, **kwargs: Any) -> Any:
        return self._send("GET", _pod(name, namespace), kwargs)

    def patch_namespaced_pod(self, name: str, namespace: str, body: Any, **kwargs: Any) -> Any:
        return self._send("PATCH", _pod(name, namespace), kwargs, body)

    def patch_namespaced_pod_status(
        self, name: str, namespace: str, body: Any, **kwargs: Any
    ) -> Any:
        return self._send("PATCH", _pod(name, namespace) + "/status", kwargs, body)

    def delete_namespaced_pod(
        self, name: str, namespace: str, body: Any = None, **kwargs: Any
    ) -> Any:
        return self._send("DELETE", _pod(name, namespace), kwargs, body)

    def create_namespaced_pod_eviction(
        self, name: str, namespace: str, body: Any, **kwargs: Any
    ) -> Any:
        return self._send("POST", _pod(name, namespace) + "/eviction", kwargs, body)

    def list_namespace(self, **kwargs: Any) -> Any:
        return self._send("GET", "/api/v1/namespaces", kwargs)

    def list_node(self, **kwargs: Any) -> Any:
        return self._send("GET", "/api/v1/nodes", kwargs)

    def read_node(self, name: str, **kwargs: Any) -> Any:
        return self._send("GET", f"/api/v1/nodes/{_part(name)}", kwargs)

    def patch_node(self, name: str, body: Any, **kwargs: Any) -> Any:
        return self._send("PATCH", f"/api/v1/nodes/{_part(name)}", kwargs, body)

    def patch_node_status(self, name: str, body: Any, **kwargs: Any) -> Any:
        return self._send("PATCH", f"/api/v1/nodes/{_part(name)}/status", kwargs, body)

    def get_code(self, **kwargs: Any) -> Any:
        """GET /version (VersionApi's name for it): the cluster's Kubernetes version."""
        return self._send("GET", "/version", kwargs)


class LeaseApi(RawApi):
    """The Leases of coordination.k8s.io/v1: the agents' (watched) and the election's own."""

    def list_namespaced_lease(self, namespace: str, **kwargs: Any) -> Any:
        return self._send("GET", _leases(namespace), kwargs)

    def read_namespaced_lease(self, name: str, namespace: str, **kwargs: Any) -> Any:
        return self._send("GET", f"{_leases(namespace)}/{_part(name)}", kwargs)

    def create_namespaced_lease(self, namespace: str, body: Any, **kwargs: Any) -> Any:
        return self._send("POST", _leases(namespace), kwargs, body)

    def replace_namespaced_lease(self, name: str, namespace: str, body: Any, **kwargs: Any) -> Any:
        return self._send("PUT", f"{_leases(namespace)}/{_part(name)}", kwargs, body)


class EventApi(RawApi):
    """The Events of events.k8s.io/v1 the operator records about pods and policies."""

    def create_namespaced_event(self, namespace: str, body: Any, **kwargs: Any) -> Any:
        return self._send("POST", _events(namespace), kwargs, body)

    def patch_namespaced_event(self, name: str, namespace: str, body: Any, **kwargs: Any) -> Any:
        return self._send("PATCH", f"{_events(namespace)}/{_part(name)}", kwargs, body)


def _content_type(method: str, body: Any) -> str:
    """As CoreV1Api chooses it: a patch is a JSON patch where it is a list of operations, a
    strategic merge patch otherwise; every other body is JSON."""
    if method != "PATCH":
        return "application/json"
    if isinstance(body, list):
        return "application/json-patch+json"
    return "application/strategic-merge-patch+json"


def _part(value: str) -> str:
    """A name as one part of a path, quoted as CoreV1Api quotes it (names of pods, namespaces
    and nodes hold no '/', but a caller's mistake must not reach another path)."""
    if not value or "/" in value or value in (".", ".."):
        raise ValueError(f"not a name: {value!r}")
    return quote(value, safe="")


def _pod(name: str, namespace: str) -> str:
    return f"/api/v1/namespaces/{_part(namespace)}/pods/{_part(name)}"


def _leases(namespace: str) -> str:
    return f"/apis/coordination.k8s.io/v1/namespaces/{_part(namespace)}/leases"


def _events(namespace: str) -> str:
    return f"/apis/events.k8s.io/v1/namespaces/{_part(namespace)}/events"
