"""The errors the client raises: every one a ``shardd.Error``. Public through ``shardd`` and
``shardd.client`` (which keeps them named ``shardd.client.X`` in tracebacks and pickles).

Most take one argument, a message: torch re-raises a DataLoader worker's exception in the
trainer as ``type(text)``."""


class Error(Exception):
    """Base class of the errors this client raises."""


class DaemonError(Error):
    """An error the daemon reported in an ERROR frame. ``str(e)`` is the daemon's message;
    ``e.code`` is the machine-readable code (see proto/PROTOCOL.md)."""

    def __init__(self, code, message=None):
        # One argument is a message: torch re-raises a worker's exception as ``type(text)``.
        if message is None:
            code, message = "", code
        super().__init__(message)
        self.code = code


class ProtocolError(Error):
    """The peer did not follow the protocol (not a shardd socket, a malformed frame, ...)."""


class ConnectionLostError(ProtocolError, ConnectionError):
    """The connection to the daemon was cut (the daemon was killed, restarted or stopped), and
    the stream could not reconnect: ``reconnect_timeout=0``. (With reconnecting on, a daemon
    that does not come back raises ``UnavailableError``.)"""

    def __init__(self, message):  # one argument: torch re-raises a worker's error as type(text)
        super().__init__(message)


class UnavailableError(Error, ConnectionError):
    """No shardd daemon could be reached at the socket: at once when the path cannot be a
    daemon's socket (not a directory, permission denied) or ``reconnect_timeout=0``; after
    ``first_connect_timeout`` seconds when a client's first connection finds no socket file
    there; else once ``reconnect_timeout`` seconds of attempts have passed. The message names
    the socket, the time waited and the cause (for no socket and for permission denied, the
    likely reasons and the settings that change them).

    ``errno``: the connect() error behind it, if there was one. ``absent``: for a first
    connection that found no socket, the facts its message was made of (``shardd.torch`` and
    ``shardd.grain`` tell the same with their own argument names); else None."""

    def __init__(self, message, retry=False, reason=None, errno=None, absent=None):
        super().__init__(message)
        self.retry = retry  # whether a daemon (re)starting there would explain it
        self.reason = reason or message  # the cause alone, e.g. "Connection refused"
        self.errno = errno
        self.absent = absent


class StreamTimeoutError(Error, TimeoutError):
    """The daemon sent nothing for the ``timeout`` given to ``Client``. Not retried: the
    timeout is the caller's bound."""

    def __init__(self, message):
        super().__init__(message)


class VersionError(Error):
    """The daemon speaks an older protocol than a feature the request uses (``feature``,
    ``needed``): upgrade the daemon. ``daemon`` is the daemon's protocol version."""

    def __init__(self, message, daemon=None, needed=None, feature=None):
        super().__init__(message)
        self.daemon, self.needed, self.feature = daemon, needed, feature


class PlanMismatch(Error, RuntimeError):
    """Two views of one epoch's plan disagree: ranks of a job (``shardd.torch``'s check at
    ``set_epoch``), or a position and the daemon's plan now (``PlanChangedError``). Reading on
    would repeat and skip samples, or hang a synchronous job. (``shardd.torch.PlanMismatch``
    is this class.)"""

    def __init__(self, message):  # one argument: torch re-raises a worker's error as type(text)
        super().__init__(message)


class PlanChangedError(PlanMismatch):
    """A stream was to continue at a position (after a reconnect, or from a saved state) but
    the daemon now plans another order for it: its config (shards, manifest, host count,
    dataset settings) changed. ``old`` and ``new`` are the two plan fingerprints."""

    def __init__(self, message, old=None, new=None):
        super().__init__(message)
        self.old, self.new = old, new


class ForkedStreamError(Error, RuntimeError):
    """A stream opened in one process was read in another after ``fork``: the two processes
    would share one socket and each get part of the bytes. Open streams after the fork, in the
    process that reads them."""

    def __init__(self, message):  # one argument: torch re-raises a worker's error as type(text)
        super().__init__(message)
