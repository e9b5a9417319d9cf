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
    VersionError,
    next_history,
)
from ._seeds import sample_seed

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
    "VersionError",
    "sample_seed",
    "next_history",
]
# The one version: the crate's (Cargo.toml). tests/python/test_wheel.py checks that this, the
# wheel's metadata, `shardd --version` and clients/python/pyproject.toml agree.
__version__ = "0.1.0"
