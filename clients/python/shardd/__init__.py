"""Python client for shardd, the per-host WebDataset streaming daemon."""

from .client import (
    Client,
    ConnectionLostError,
    DaemonError,
    Error,
    ForkedStreamError,
    PlanChangedError,
    PlanMismatch,
    ProtocolError,
    Stream,
    StreamTimeoutError,
    UnavailableError,
)

__all__ = [
    "Client",
    "Stream",
    "Error",
    "DaemonError",
    "ProtocolError",
    "ConnectionLostError",
    "UnavailableError",
    "StreamTimeoutError",
    "PlanMismatch",
    "PlanChangedError",
    "ForkedStreamError",
]
__version__ = "0.1.0"
