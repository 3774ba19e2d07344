"""kopf's settings and credentials for this operator, each for a reason given where it is set."""

from __future__ import annotations

from pathlib import Path

import kopf

from gpuusage.kube.config import CONNECT_TIMEOUT, REQUEST_TIMEOUT, api_client
from gpuusage.retry import Backoff


def retry_forever() -> Backoff:
    """Backoffs for kopf's API requests that never run out: 1, 1, 2, 3, 5, then every 10 s."""
    return Backoff((1, 1, 2, 3, 5), then=10)


def configure_kopf(
    settings: kopf.OperatorSettings, request_timeout: float = REQUEST_TIMEOUT
) -> None:
    """kopf's settings for this operator (the startup handler applies them).

    kopf is the operator's runtime and nothing more: its event loop, the startup and cleanup
    handlers, the login, the liveness endpoint. It watches nothing. No resource handler is
    registered (the operator's informers watch what it reads, see informers), so its
    observation of the cluster's CRDs, which serves handlers only, is off: kopf reads the API's
    discovery once at start. It runs without peering on every replica (the Lease decides who
    acts: ha.leader), and posts no Events of its own."""
    settings.scanning.disabled = True
    settings.posting.enabled = False
    # Client-side bounds on kopf's requests, as on ours (kube.config).
    settings.networking.connect_timeout = CONNECT_TIMEOUT
    settings.networking.request_timeout = request_timeout
    # kopf gives up a request after its backoffs (54 s in all) and then stops: an operator
    # starting while the apiserver restarts would fail its discovery and exit. Retry for as
    # long as it takes (the informers do too).
    settings.networking.error_backoffs = retry_forever()


def connection_info(kubeconfig: Path | None) -> kopf.ConnectionInfo:
    """kopf's credentials from the loader every other client of the operator uses (the
    `kubernetes` package's, found as kube.config finds it): kubeconfig users with client
    certificates, tokens, token files or exec credential plugins (what EKS, GKE and AKS
    write), or the in-cluster service account."""
    api, _source = api_client(kubeconfig)
    try:
        config = api.configuration
        header = config.get_api_key_with_prefix("BearerToken") or config.get_api_key_with_prefix(
            "authorization"
        )
    finally:
        api.close()  # type: ignore[no-untyped-call]
    scheme, _, token = (header or "").rpartition(" ")
    return kopf.ConnectionInfo(
        server=config.host,
        ca_path=config.ssl_ca_cert,
        insecure=not config.verify_ssl or None,
        certificate_path=config.cert_file,
        private_key_path=config.key_file,
        scheme=scheme or ("Bearer" if token else None),
        token=token or None,
    )
