"""Python client for shardd, the per-host WebDataset streaming daemon."""

from .client import Client, DaemonError, Error, ProtocolError, Stream

__all__ = ["Client", "Stream", "Error", "DaemonError", "ProtocolError"]
__version__ = "0.1.0"
