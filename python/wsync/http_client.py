"""A client for vLLM's weight-transfer HTTP routes, as a wsync consumer serves them (urllib only).

The routes, bodies and answers are those of ``docs/http.md``: the four phases
(``/init_weight_transfer_engine``, ``/start_weight_update``, ``/update_weights``,
``/finish_weight_update``), ``/pause`` / ``/resume`` / ``/is_paused``, ``/get_world_size``, and
wsync's ``/status`` and ``/health``. The same client drives a vLLM server started with
``VLLM_SERVER_DEV_MODE=1``.

Besides the short names (``init``, ``start``, ``update``, ``finish``) the client has the four
methods of vLLM's ``VLLMWeightSyncClient`` protocol (``init_weight_transfer_engine``,
``start_weight_update``, ``update_weights``, ``finish_weight_update``), so a vLLM trainer engine
(and :class:`wsync.vllm.WsyncTrainerEngine`) can use it as its client.

Errors: a non-2xx answer raises :class:`wsync.HTTPError`, which is also the error class of what
went wrong (409 -> ``IllegalTransitionError``, 400 -> ``InvalidArgumentError`` or the code the
message names, a failed install at finish -> ``InstallFailedError``); the message names the
method, the path and the server's own message. A server that cannot be reached raises
``TransportIOError``, one that does not answer in time ``WeightSyncTimeoutError``.
"""

import http.client
import json
import socket
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Dict, List, Optional, Union

from wsync._errors import WeightSyncError, error_for, http_error

__all__ = ["VLLMHTTPClient"]

JSON = Dict[str, Any]


def _jsonable(value: Any) -> Any:
    # json.dumps default: a wsync Manifest (anything with to_json) travels as its JSON object.
    to_json = getattr(value, "to_json", None)
    if callable(to_json):
        return json.loads(to_json())
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def _server_message(body: str) -> str:
    # The reason the server gave: {"error": ...} (vLLM's and wsync's routes), {"message": ...}
    # (SGLang's), FastAPI's {"detail": ...}, or the raw text.
    try:
        j = json.loads(body)
    except ValueError:
        return body.strip()
    if isinstance(j, dict):
        for key in ("error", "message", "detail"):
            if key in j:
                v = j[key]
                return v if isinstance(v, str) else json.dumps(v)
    return body.strip()


def _code_for(status: int, path: str, message: str) -> str:
    # The wsync error code an HTTP answer means: the server's texts name blocked requests,
    # versions that did not increase and checksum failures; the status says the rest.
    if "blocked:" in message:
        return "blocked"
    if "must increase monotonically" in message:
        return "version_not_monotonic"
    if status == 409:
        return "illegal_transition"
    if status in (408, 504):
        return "timeout"
    if 400 <= status < 500:
        return "invalid_argument"
    if path == "/finish_weight_update" or "install failed" in message:
        return "install_failed"
    return "io_error"


class VLLMHTTPClient:
    """Drives a vLLM-compatible weight-transfer HTTP server (a wsync consumer, or vLLM itself).

    Args:
        base_url: the server's root, e.g. ``http://127.0.0.1:8000`` (a trailing ``/`` is fine).
        token: when given, every request carries ``Authorization: Bearer <token>`` (a wsync
            consumer started with ``--http-token`` answers 401 without it).
        timeout: seconds to wait for each answer. ``finish`` installs the update before it
            answers, so give large models room.
    """

    def __init__(self, base_url: str, token: Optional[str] = None, timeout: float = 30.0) -> None:
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise error_for("invalid_argument",
                            f"base_url: {base_url!r} is not an http:// or https:// URL")
        self.base_url = base_url.rstrip("/")
        self.token = token
        self.timeout = timeout

    def __repr__(self) -> str:
        return f"VLLMHTTPClient({self.base_url!r}, token={'***' if self.token else None})"

    # -- the four phases ------------------------------------------------------------------------

    def init(self, init_info: JSON) -> JSON:
        """Opens the weight transfer: ``POST /init_weight_transfer_engine {"init_info": ...}``.

        For a wsync consumer ``init_info`` names the transport (``{"transport":
        "shared-memory"}``, the default) and its ``transport_options``. A second init must name
        the same transport and options; one sent while an update is started drops that update
        (a restarted trainer begins anew) and the next call is ``start``.

        Returns:
            The server's answer, ``{"message": "Weight transfer initialized"}``.
        """
        if not isinstance(init_info, dict):
            raise error_for("invalid_argument", "init_info: must be a dict")
        return self._request("POST", "/init_weight_transfer_engine", {"init_info": init_info})

    def start(self, is_checkpoint_format: Optional[bool] = True) -> JSON:
        """Starts an update: ``POST /start_weight_update {"is_checkpoint_format": ...}``.

        Args:
            is_checkpoint_format: sent as the body's flag (vLLM between #39212 and #44353 reads
                it); ``None`` sends a bare POST, as vLLM's newest clients do.

        Returns:
            ``{"message": "Weight update started"}``. A 409 names the current phase when an
            update is already started or the transfer was never initialised.
        """
        body = None if is_checkpoint_format is None else {
            "is_checkpoint_format": bool(is_checkpoint_format)}
        return self._request("POST", "/start_weight_update", body)

    def update(self, update_info: Union[JSON, List[JSON]]) -> JSON:
        """Sends one chunk: ``POST /update_weights {"update_info": ...}``.

        Args:
            update_info: a dict, or a non-empty list of dicts. For wsync the dict carries
                ``manifest`` (a :class:`wsync.Manifest`, its JSON text or its JSON object) and
                optionally ``names`` / ``dtype_names`` / ``shapes`` describing the chunk. A
                Manifest object anywhere in it is sent as its JSON object.

        Returns:
            ``{"message": "Weights updated"}``.
        """
        if isinstance(update_info, list):
            if not update_info or not all(isinstance(i, dict) for i in update_info):
                raise error_for("invalid_argument",
                                "update_info: a list must be non-empty and hold only dicts")
        elif not isinstance(update_info, dict):
            raise error_for("invalid_argument", "update_info: must be a dict or a list of dicts")
        return self._request("POST", "/update_weights", {"update_info": update_info})

    def finish(self, weight_version: Optional[Union[int, str]] = None) -> JSON:
        """Finishes the update: ``POST /finish_weight_update``, installing it atomically.

        Args:
            weight_version: when given, sent as ``{"weight_version": "<v>"}``. With manifests a
                number must equal the manifests' version (400 otherwise); other text (``"step-12"``)
                labels the installed version, as any value does in NCCL mode, where the server
                numbers versions itself. ``None``: a bare POST.

        Returns:
            ``{"message": "Weight update finished", "weight_version": <installed version>}``.
            A failed install raises :class:`wsync.InstallFailedError` (HTTP 500) and the
            previous version stays active.
        """
        body = None if weight_version is None else {"weight_version": str(weight_version)}
        return self._request("POST", "/finish_weight_update", body)

    # vLLM's VLLMWeightSyncClient protocol: the same four calls under vLLM's names.

    def init_weight_transfer_engine(self, init_info: JSON) -> None:
        """vLLM's client protocol: :meth:`init`."""
        self.init(init_info)

    def start_weight_update(self) -> None:
        """vLLM's client protocol: :meth:`start` with a bare POST."""
        self.start(None)

    def update_weights(self, update_info: Union[JSON, List[JSON]]) -> None:
        """vLLM's client protocol: :meth:`update`."""
        self.update(update_info)

    def finish_weight_update(self) -> None:
        """vLLM's client protocol: :meth:`finish` with a bare POST."""
        self.finish(None)

    # -- generation control ---------------------------------------------------------------------

    def pause(self, mode: str = "abort") -> JSON:
        """Pauses generation: ``POST /pause?mode=<mode>``.

        Args:
            mode: ``abort`` (in-flight generations end), ``wait`` (they run to completion) or
                ``keep`` (they hold and continue after :meth:`resume`). Another value is refused
                by the server with 400.

        Returns:
            ``{"status": "paused"}``, once the mode's condition holds.
        """
        query = urllib.parse.urlencode({"mode": mode})
        return self._request("POST", "/pause?" + query, None)

    def resume(self) -> JSON:
        """Resumes generation: ``POST /resume``; returns ``{"status": "resumed"}``."""
        return self._request("POST", "/resume", None)

    def is_paused(self) -> bool:
        """Whether generation is paused (``GET /is_paused``)."""
        return bool(self._field(self._request("GET", "/is_paused"), "is_paused", "/is_paused"))

    def world_size(self, include_dp: bool = True) -> int:
        """The server's world size (``GET /get_world_size?include_dp=...``).

        Args:
            include_dp: count data-parallel replicas too (TP x PP x DP); ``False``: TP x PP.
        """
        query = urllib.parse.urlencode({"include_dp": "true" if include_dp else "false"})
        answer = self._request("GET", "/get_world_size?" + query)
        return int(self._field(answer, "world_size", "/get_world_size"))

    # -- weight version and weight checker (vLLM's newest routes) -------------------------------

    def weight_info(self) -> JSON:
        """The label of the weights served (``GET /weight_info``): ``{"weight_version": str}``."""
        return self._request("GET", "/weight_info")

    def update_weight_version(self, new_version: str, abort_all_requests: bool = False) -> JSON:
        """Relabels the active weights (``POST /update_weight_version``).

        Args:
            new_version: the new label (a non-empty string).
            abort_all_requests: end in-flight generations first.
        """
        return self._request("POST", "/update_weight_version",
                             {"new_version": new_version,
                              "abort_all_requests": bool(abort_all_requests)})

    def weight_checker(self, action: str = "checksum", baseline: Optional[Dict[str, str]] = None,
                       rank: Optional[int] = None) -> JSON:
        """Proves what a rank serves (``POST /weight_checker``).

        Args:
            action: ``checksum`` (SHA-256 of every active tensor, kept as the rank's baseline),
                ``compare`` (against ``baseline`` or the kept one) or ``reset``.
            baseline: ``{name: sha256 hex}`` for ``compare``.
            rank: the rank of a coordinator-driven process (default: its first).

        Returns:
            ``checksum``: ``{"checksums": {...}, "weight_version": int, "rank": int}``;
            ``compare``: ``{"match": bool, "mismatches": [...], "compared": int, ...}``.
        """
        body: JSON = {"action": action}
        if baseline is not None:
            body["baseline"] = baseline
        if rank is not None:
            body["rank"] = rank
        return self._request("POST", "/weight_checker", body)

    # -- wsync's own routes ---------------------------------------------------------------------

    def status(self) -> JSON:
        """wsync's status object (``GET /status``): ranks, recent updates,
        ``active_weight_version``, ``paused`` and ``phase``."""
        return self._request("GET", "/status")

    def health(self) -> bool:
        """Whether the server answers ``GET /health`` with 2xx.

        Never raises: ``False`` when the server cannot be reached, does not answer in time or
        refuses the request (a wrong or missing token included), so it suits wait loops.
        """
        try:
            self._request("GET", "/health")
        except WeightSyncError:
            return False
        return True

    # -- plumbing -------------------------------------------------------------------------------

    @staticmethod
    def _field(answer: JSON, key: str, path: str) -> Any:
        if key not in answer:
            raise error_for("io_error", f"GET {path}: the answer has no \"{key}\": {answer}")
        return answer[key]

    def _request(self, method: str, path_and_query: str, body: Optional[Any] = None) -> JSON:
        """One request; the decoded JSON answer, or a WeightSyncError naming method and path."""
        path = path_and_query.split("?", 1)[0]
        where = f"{method} {path}"
        data = None
        headers = {"Accept": "application/json"}
        if body is not None:
            data = json.dumps(body, default=_jsonable).encode()
            headers["Content-Type"] = "application/json"
        if self.token:
            headers["Authorization"] = "Bearer " + self.token
        request = urllib.request.Request(self.base_url + path_and_query, data=data,
                                         headers=headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                text = response.read().decode("utf-8", "replace")
        except urllib.error.HTTPError as e:
            try:
                text = e.read().decode("utf-8", "replace") if e.fp is not None else ""
            except (OSError, http.client.HTTPException):  # the error body itself was cut off
                text = ""
            message = _server_message(text) or e.reason or "no reason given"
            raise http_error(e.code, _code_for(e.code, path, message),
                             f"{where}: HTTP {e.code}: {message}", body=text,
                             path=path) from None
        except (socket.timeout, TimeoutError) as e:
            raise error_for("timeout", f"{where}: no answer from {self.base_url} within "
                                       f"{self.timeout} s ({e})") from None
        except urllib.error.URLError as e:
            reason = e.reason
            if isinstance(reason, (socket.timeout, TimeoutError)):
                raise error_for("timeout", f"{where}: no answer from {self.base_url} within "
                                           f"{self.timeout} s") from None
            raise error_for("io_error",
                            f"{where}: cannot reach {self.base_url}: {reason}") from None
        except OSError as e:  # a reset connection, a closed socket mid-answer
            raise error_for("io_error", f"{where}: {self.base_url}: {e}") from None
        except http.client.HTTPException as e:  # not HTTP (a TLS port), or an answer cut short
            raise error_for("io_error", f"{where}: {self.base_url}: not a valid HTTP answer: "
                                        f"{type(e).__name__}: {e}") from None
        if not text.strip():
            return {}
        try:
            answer = json.loads(text)
        except ValueError:
            raise error_for("io_error",
                            f"{where}: the answer is not JSON: {text[:200]!r}") from None
        if not isinstance(answer, dict):
            raise error_for("io_error", f"{where}: the answer is not a JSON object: {text[:200]}")
        return answer
