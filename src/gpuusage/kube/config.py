"""Find the Kubernetes API the way kubectl and kopf users expect.

Order: an explicit --kubeconfig, else $KUBECONFIG (which may list several files), else the
in-cluster service account, else ~/.kube/config. Each call builds its own client configuration:
nothing is global and nothing happens at import time.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from gpuusage.errors import GpuusageError

if TYPE_CHECKING:
    from kubernetes import client

IN_CLUSTER_TOKEN = Path("/var/run/secrets/kubernetes.io/serviceaccount/token")

Origin = Literal["flag", "env", "in-cluster", "home"]


class KubeConfigError(GpuusageError):
    """No usable way to reach the API was found."""


@dataclass(frozen=True)
class ApiSource:
    """Which configuration was chosen, for the start-up log line."""

    origin: Origin
    detail: str


def choose_source(
    kubeconfig: Path | None,
    environ: dict[str, str] | None = None,
    home: Path | None = None,
    token_path: Path = IN_CLUSTER_TOKEN,
) -> ApiSource:
    """Pure decision of where the API configuration comes from."""
    environ = dict(os.environ) if environ is None else environ
    if kubeconfig is not None:
        return ApiSource("flag", str(kubeconfig))
    if environ.get("KUBECONFIG"):
        return ApiSource("env", environ["KUBECONFIG"])
    if environ.get("KUBERNETES_SERVICE_HOST") and token_path.exists():
        return ApiSource("in-cluster", environ["KUBERNETES_SERVICE_HOST"])
    home_config = (home or Path.home()) / ".kube" / "config"
    if home_config.exists():
        return ApiSource("home", str(home_config))
    raise KubeConfigError(
        "cannot find the Kubernetes API: pass --kubeconfig, set KUBECONFIG, run in a pod with a "
        f"service account, or create {home_config}"
    )


def api_client(
    kubeconfig: Path | None = None,
    pool_size: int | None = None,
    *,
    retries: int | None = None,
    request_timeout: float | None = None,
    context: str | None = None,
) -> tuple[client.ApiClient, ApiSource]:
    """A fresh ApiClient of the `kubernetes` package for the chosen source; pool_size sets how
    many connections it keeps (the default suits one thread at a time); retries, how often
    urllib3 itself retries a failed request (its default 3; 0 for callers that retry with
    their own backoff, so that an outage is seen within one request's timeout);
    request_timeout, the read timeout of every request that names none (REQUEST_TIMEOUT);
    context, the kubeconfig's context to use (None: its current one), as kubectl's --context.

    Imported here, not at module level: the node agent resolves the same sources without that
    package (see gpuusage.kube.rest).
    """
    from kubernetes import client, config  # noqa: PLC0415
    from kubernetes.config.config_exception import ConfigException  # noqa: PLC0415

    source = choose_source(kubeconfig)
    if context is not None and source.origin == "in-cluster":
        raise KubeConfigError(f"--context {context} needs a kubeconfig; none was found")
    configuration = client.Configuration()
    try:
        # The config loaders carry no type hints.
        if source.origin == "in-cluster":
            config.load_incluster_config(  # type: ignore[no-untyped-call]
                client_configuration=configuration
            )
        else:
            # KUBECONFIG may hold several paths separated by ':'; the loader merges them.
            config.load_kube_config(  # type: ignore[no-untyped-call]
                config_file=source.detail, context=context, client_configuration=configuration
            )
    except (ConfigException, OSError, ValueError) as exc:
        raise KubeConfigError(f"cannot load {source.origin} config {source.detail}: {exc}") from exc
    if pool_size is not None:
        configuration.connection_pool_maxsize = pool_size
    if retries is not None:
        configuration.retries = retries
    api = client.ApiClient(configuration)
    with_timeouts(api.rest_client, request_timeout or REQUEST_TIMEOUT)
    return api, source


CONNECT_TIMEOUT = 10.0
"""Seconds to connect and shake hands with the apiserver, for every request."""
REQUEST_TIMEOUT = 60.0
"""Seconds a request may wait for the next bytes of its answer (a read timeout): a half-open
connection fails within this instead of holding a caller for good. Watches set their own."""


def with_timeouts(rest: Any, read: float = REQUEST_TIMEOUT) -> None:
    """Give every request of this `kubernetes` REST client a client-side timeout unless the
    call names one (`_request_timeout`): the package itself sends none, so a connection whose
    peer vanished without closing it would block its caller forever."""
    send = rest.request

    def request(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("_request_timeout") is None:
            kwargs["_request_timeout"] = (CONNECT_TIMEOUT, read)
        return send(*args, **kwargs)

    rest.request = request
