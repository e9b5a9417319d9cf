"""Python client for shardd, the per-host WebDataset streaming daemon."""

from .client import Client, DaemonError, Error, ForkedStreamError, ProtocolError, Stream

__all__ = ["Client", "Stream", "Error", "DaemonError", "ForkedStreamError", "ProtocolError"]
__version__ = "0.1.0"
