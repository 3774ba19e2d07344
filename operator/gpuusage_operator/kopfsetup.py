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
    settings: kopf.OperatorSettings,
    request_timeout: float = REQUEST_TIMEOUT,
    watch_idle: float = 70.0,
) -> None:
    """kopf's settings for this operator (the startup handler applies them). kopf runs
    without peering on every replica (the Lease decides who acts: ha.leader) and has no
    resource handler: the operator's informers watch what it reads (see informers), so no
    diff base nor progress is ever stored on an object."""
    settings.posting.enabled = False
    settings.watching.server_timeout = 300
    # Client-side bounds on every request and watch of kopf's own, as ours have
    # (kube.config): a half-open connection fails instead of freezing a watch. A watch that
    # hears nothing, not even a bookmark, for the inactivity timeout is started again.
    settings.networking.connect_timeout = CONNECT_TIMEOUT
    settings.networking.request_timeout = request_timeout
    settings.watching.connect_timeout = CONNECT_TIMEOUT
    settings.watching.client_timeout = 300 + request_timeout
    settings.watching.inactivity_timeout = watch_idle
    # kopf gives up a request after its backoffs (54 s in all) and then stops what made it for
    # good: several apiserver restarts in a row left an operator whose reports kopf watched
    # deaf until it was restarted (benchmarks/README.md, fault soak). Retry for as long as it
    # takes.
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
