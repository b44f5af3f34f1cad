"""The deployment's shared secret, and when it is required.

Control messages (router <-> workers, heartbeats, and P <-> D link messages) carry an
HMAC-SHA256 tag when a secret is set (`messages.set_key`): a peer without the secret can neither
forge a request nor make a worker act on one. The secret comes from `--secret-file` or the
`PDSERVE_SECRET` environment variable (which `pdserve serve` hands to the workers it starts).
On loopback it is optional; a worker or router that listens on or talks to any other address
refuses to start without one — the anchors' users learned what an unauthenticated ZeroMQ port
on a network means.

KV frames are not tagged (a MAC per frame would cost more than the transfer's CRC-32C); a frame
is only accepted for a request that a tagged `ExpectKV` reserved, from the worker a tagged
`KVWant` announced.
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

ENV = "PDSERVE_SECRET"
MIN_SECRET_BYTES = 16


def load_secret(path: str | os.PathLike[str] | None = None) -> bytes | None:
    """The secret from `path`, else from $PDSERVE_SECRET, else None; too short is an error."""
    if path is not None:
        try:
            raw = Path(path).read_bytes().strip()
        except OSError as e:
            raise ValueError(f"cannot read the secret file {path}: {e.strerror}") from None
    else:
        env = os.environb.get(ENV.encode())  # bytes: a secret need not be text
        if not env:
            return None
        raw = env.strip()
    if len(raw) < MIN_SECRET_BYTES:
        raise ValueError(f"the shared secret must be at least {MIN_SECRET_BYTES} bytes")
    return raw


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1, localhost, and the ipc/inproc transports (no network)."""
    if host.startswith(("ipc://", "inproc://")):
        return True
    if host.startswith("tcp://"):
        host = host[len("tcp://") :].rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve anywhere


def require_secret(addresses: list[str], secret: bytes | None) -> None:
    """Refuse to run unauthenticated on anything but loopback."""
    exposed = [a for a in addresses if not is_loopback(a)]
    if exposed and secret is None:
        raise ValueError(
            f"{', '.join(exposed)} is not loopback: control messages must be authenticated; "
            f"set {ENV} (or --secret-file) to a shared secret of >= {MIN_SECRET_BYTES} bytes "
            "on the router and every worker"
        )
