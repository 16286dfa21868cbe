"""wsync's Python exceptions: one class per C++ error code (``wsync::errc``), plus HTTP errors.

Every error is a :class:`WeightSyncError` carrying ``code`` (the C++ code's name, as logs and JSON
print it) and ``message`` (the text that names the field or call and why). :func:`error_for` picks
the class for a code, so errors coming from the extension, from a manifest or from an HTTP answer
all raise the same classes and ``except wsync.IllegalTransitionError`` catches each of them.

An HTTP answer that is not 2xx raises an :class:`HTTPError` that is also the class of its code:
a 409 is both ``HTTPError`` and ``IllegalTransitionError``, with ``status`` and ``body`` kept.
"""

from typing import Dict, Optional, Type

__all__ = [
    "WeightSyncError",
    "InvalidManifestError",
    "VersionNotMonotonicError",
    "IllegalTransitionError",
    "ChecksumMismatchError",
    "UnknownUpdateError",
    "UnknownTransportError",
    "InvalidArgumentError",
    "BlockedError",
    "WeightSyncTimeoutError",
    "TransportIOError",
    "InstallFailedError",
    "HTTPError",
    "error_for",
    "http_error",
]


class WeightSyncError(Exception):
    """Base of every wsync error.

    Attributes:
        code: the C++ error code's name (``"invalid_argument"``, ``"checksum_mismatch"``, ...).
        message: what failed, naming the field or call first.
    """

    code = "error"

    def __init__(self, message: str = "", code: Optional[str] = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code

    def __str__(self) -> str:
        return self.message

    def __reduce__(self):
        return (error_for, (self.code, self.message))


class InvalidManifestError(WeightSyncError):
    """A manifest field is malformed or inconsistent."""

    code = "invalid_manifest"


class VersionNotMonotonicError(WeightSyncError):
    """A weight_version did not increase."""

    code = "version_not_monotonic"


class IllegalTransitionError(WeightSyncError):
    """A lifecycle call came in the wrong state (HTTP 409: a phase called out of order)."""

    code = "illegal_transition"


class ChecksumMismatchError(WeightSyncError):
    """Tensor bytes differ from the manifest's checksum."""

    code = "checksum_mismatch"


class UnknownUpdateError(WeightSyncError):
    """No update with this id is known here."""

    code = "unknown_update"


class UnknownTransportError(WeightSyncError):
    """No transport is registered under this name."""

    code = "unknown_transport"


class InvalidArgumentError(WeightSyncError):
    """A caller-supplied value is missing, malformed or out of range."""

    code = "invalid_argument"


class BlockedError(WeightSyncError):
    """The transport or request cannot run here; the message gives the cause."""

    code = "blocked"


class WeightSyncTimeoutError(WeightSyncError):
    """A bounded wait ran out."""

    code = "timeout"


class TransportIOError(WeightSyncError):
    """An operating-system or network call failed."""

    code = "io_error"


class InstallFailedError(WeightSyncError):
    """The rollout side refused to install the update; the previous version stays active."""

    code = "install_failed"


class HTTPError(WeightSyncError):
    """A non-2xx HTTP answer.

    Raised as a class that is also the error of its code (see :func:`http_error`), so callers
    may catch either ``HTTPError`` or e.g. ``IllegalTransitionError``.

    Attributes:
        status: the HTTP status code.
        body: the answer's body as text.
        path: the request path (``/finish_weight_update``), without the query.
    """

    def __init__(self, message: str = "", code: Optional[str] = None, status: int = 0,
                 body: str = "", path: str = "") -> None:
        super().__init__(message, code)
        self.status = status
        self.body = body
        self.path = path

    def __reduce__(self):
        return (http_error, (self.status, self.code, self.message, self.body, self.path))


_BY_CODE: Dict[str, Type[WeightSyncError]] = {
    cls.code: cls
    for cls in (InvalidManifestError, VersionNotMonotonicError, IllegalTransitionError,
                ChecksumMismatchError, UnknownUpdateError, UnknownTransportError,
                InvalidArgumentError, BlockedError, WeightSyncTimeoutError, TransportIOError,
                InstallFailedError)
}


def _http_class(base: Type[WeightSyncError]) -> Type[HTTPError]:
    # HTTPError plus the code's class; named at module level so that it pickles.
    name = "HTTP" + base.__name__
    cls = type(name, (HTTPError, base), {"__module__": __name__, "__qualname__": name,
                                         "__doc__": f"{base.__name__} from an HTTP answer."})
    return cls


_HTTP_BY_CODE: Dict[str, Type[HTTPError]] = {}
for _code, _cls in _BY_CODE.items():
    _HTTP_BY_CODE[_code] = _http_class(_cls)
    globals()[_HTTP_BY_CODE[_code].__name__] = _HTTP_BY_CODE[_code]
del _code, _cls


def error_for(code: str, message: str) -> WeightSyncError:
    """The error for a C++ error code's name: an instance of its subclass.

    An unknown code gives a plain :class:`WeightSyncError` that keeps the code.
    """
    cls = _BY_CODE.get(code)
    return cls(message) if cls is not None else WeightSyncError(message, code)


def http_error(status: int, code: str, message: str, body: str = "",
               path: str = "") -> HTTPError:
    """An :class:`HTTPError` that is also the error class of ``code``."""
    cls = _HTTP_BY_CODE.get(code, HTTPError)
    return cls(message, code, status=status, body=body, path=path)
