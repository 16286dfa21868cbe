"""The cluster from Python: trainer ranks that publish through a coordinator and rollout ranks
that install every committed version into a torch module in the background.

Launch conventions: ``rank``/``ranks`` default to torchrun's ``RANK``/``WORLD_SIZE`` (else
Slurm's ``SLURM_PROCID``/``SLURM_NTASKS``, else 0/1), the coordinator address and the token to
``WSYNC_COORDINATOR``/``WSYNC_TOKEN``, and the node name to ``WSYNC_NODE`` or the host name. So
``torchrun --nproc_per_node 4 train.py`` connects four trainer ranks with no extra arguments.
"""

import atexit
import concurrent.futures
import json
import os
import socket
import threading
import time
import weakref
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from wsync import _torch
from wsync import _wsync
from wsync._bridge import _Gate
from wsync._errors import (IllegalTransitionError, InvalidArgumentError, WeightSyncTimeoutError,
                           error_for)
from wsync._install import ModuleInstaller
from wsync._text import encode_metadata, options_text


def _env_int(*names: str, default: int) -> int:
    for n in names:
        v = os.environ.get(n)
        if v not in (None, ""):
            try:
                return int(v)
            except ValueError:
                raise InvalidArgumentError(f"environment {n}={v!r}: not an integer") from None
    return default


def launch_rank() -> int:
    """This process's rank from torchrun (RANK) or Slurm (SLURM_PROCID); 0 otherwise."""
    return _env_int("RANK", "SLURM_PROCID", default=0)


def launch_world_size() -> int:
    """Processes in the job from torchrun (WORLD_SIZE) or Slurm (SLURM_NTASKS); 1 otherwise."""
    return _env_int("WORLD_SIZE", "SLURM_NTASKS", default=1)


def launch_local_rank() -> int:
    """The node-local index from torchrun (LOCAL_RANK) or Slurm (SLURM_LOCALID); 0 otherwise."""
    return _env_int("LOCAL_RANK", "SLURM_LOCALID", default=0)


def _address(coordinator: Optional[str]) -> Tuple[str, int]:
    text = coordinator or os.environ.get("WSYNC_COORDINATOR", "")
    if not text:
        raise InvalidArgumentError("coordinator: give coordinator=\"host:port\" or set "
                                   "WSYNC_COORDINATOR")
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidArgumentError(f"coordinator: {text!r} is not host:port")
    return host.strip("[]"), int(port)


def _token(token: Optional[str]) -> str:
    t = token if token is not None else os.environ.get("WSYNC_TOKEN", "")
    if not t:
        raise InvalidArgumentError("token: give token=... or set WSYNC_TOKEN (the cluster token "
                                   "the coordinator was started with)")
    return t


def _tls(tls: Optional[Sequence[str]]) -> List[str]:
    if tls is None:
        cert, key, ca = (os.environ.get(n, "") for n in
                         ("WSYNC_TLS_CERT", "WSYNC_TLS_KEY", "WSYNC_TLS_CA"))
        return [cert, key, ca] if cert else []
    tls = list(tls)
    if len(tls) != 3:
        raise InvalidArgumentError("tls: give (certificate, key, ca_file) PEM paths")
    return tls


def _node(node: Optional[str]) -> str:
    return node or os.environ.get("WSYNC_NODE") or socket.gethostname()


# Ranks still open at interpreter exit are closed first: a rank's threads must not try to take
# the GIL while the interpreter is being torn down.
_open_ranks: "weakref.WeakSet" = weakref.WeakSet()


@atexit.register
def _close_open_ranks() -> None:
    for rank in list(_open_ranks):
        try:
            rank.close()
        except Exception:  # at exit: nothing left to report to
            pass


def _interruptible(fn, *args, abandoned: Optional[Callable[[Any], Any]] = None):
    """Runs a blocking call in a helper thread so Ctrl-C (KeyboardInterrupt) reaches the caller
    at once; the call itself finishes in the background within its own timeout. What it then
    returns has no owner: ``abandoned(value)`` disposes of it (closes a rank that joined)."""
    box: Dict[str, Any] = {}
    lock = threading.Lock()

    def dispose(value: Any) -> None:
        if abandoned is not None:
            try:
                abandoned(value)
            except Exception:  # nobody is left to tell
                pass

    def run():
        try:
            value = fn(*args)
        except BaseException as e:  # handed to the caller
            box["error"] = e
            return
        with lock:
            if not box.get("abandoned"):
                box["value"] = value
                return
        dispose(value)

    t = threading.Thread(target=run, name="wsync-call", daemon=True)
    try:
        t.start()
        while t.is_alive():
            t.join(0.05)
    except BaseException:
        with lock:
            box["abandoned"] = True
            landed = box.pop("value", None)
        if landed is not None:  # it returned just before the interrupt: dispose of it aside
            threading.Thread(target=dispose, args=(landed,), name="wsync-dispose",
                             daemon=True).start()
        raise
    if "error" in box:
        raise box["error"]
    return box["value"]


def _close_handle(handle: Any) -> None:
    handle.close()


def coordinator_status(coordinator: Optional[str] = None, token: Optional[str] = None,
                       tls: Optional[Sequence[str]] = None) -> dict:
    """The coordinator's status table (docs/cluster.md) as a dict."""
    host, port = _address(coordinator)
    text = _interruptible(_wsync.coordinator_status, host, port, _token(token), _tls(tls))
    return json.loads(text)


def _open_handle(handle: Any, kind: str, rank: int) -> Any:
    """A rank's handle, or IllegalTransitionError once the rank was closed."""
    if handle is None:
        raise IllegalTransitionError(f"{kind} rank {rank}: closed")
    return handle


def wait_for_consumers(count: int, coordinator: Optional[str] = None,
                       token: Optional[str] = None, timeout: float = 60.0,
                       tls: Optional[Sequence[str]] = None) -> dict:
    """Waits until `count` consumer ranks joined the coordinator; returns its status table."""
    if coordinator is not None and not isinstance(coordinator, str):
        # wait_for_consumers(2, 30) reads as a timeout but is the coordinator's place.
        raise InvalidArgumentError(f"wait_for_consumers: coordinator: {coordinator!r} is not "
                                   "'host:port' (pass timeout= by name)")
    deadline = time.monotonic() + timeout
    while True:
        status = coordinator_status(coordinator, token, tls)
        ranks = [r for r in status.get("ranks", []) if r.get("role") == "consumer"]
        if len(ranks) >= count:
            return status
        if time.monotonic() > deadline:
            raise WeightSyncTimeoutError(f"wait_for_consumers: {len(ranks)} of {count} consumer "
                                         f"ranks joined within {timeout} s")
        time.sleep(0.05)


class UpdateOutcome:
    """How one published version ended, as the coordinator saw it.

    Attributes:
        committed: every consumer rank answered before the deadline and at least one
            installed it (a rank that failed is named in ``ranks``).
        reason: why it aborted ("" when committed).
        ranks: the coordinator's per-rank table (list of dicts: rank, role, state, reason...).
        table: the whole outcome object.
        publish_s: this rank's copy + checksum + expose time.
    """

    def __init__(self, raw: dict) -> None:
        self.table: Dict[str, Any] = json.loads(raw["outcome_json"]) if raw["outcome_json"] else {}
        self.committed: bool = bool(raw["committed"])
        self.reason: str = "" if self.committed else (self.table.get("reason") or raw["error"])
        self.ranks: List[dict] = list(self.table.get("ranks", []))
        self.publish_s: float = raw["publish_s"]

    def __repr__(self) -> str:
        state = "committed" if self.committed else f"aborted: {self.reason}"
        return f"UpdateOutcome({state}, {len(self.ranks)} ranks)"


class TrainerRank:
    """A trainer rank joined to a wsync coordinator: publishes its shard of every version.

    With ``ranks`` trainer ranks, rank r publishes the tensors i of the model's state dict with
    ``i % ranks == r``; the coordinator commits a version when every consumer rank installed
    every shard.

    Args:
        coordinator: ``"host:port"`` (default ``$WSYNC_COORDINATOR``).
        model: the module (or state dict) :meth:`publish` sends when given none.
        rank, ranks: this rank and how many trainer ranks share the model (default from
            torchrun / Slurm, see the module note).
        transport: the data plane (``"shared-memory"``, ``"file-mmap"``, ``"ucx"``; with CUDA
            tensors on one GPU, ``"cuda-ipc"`` or ``"cuda-vmm"``).
        token: the cluster token (default ``$WSYNC_TOKEN``).
        model_id: the model's name in the cluster (default ``"model"``).
        options: transport options; node: this host's name for topology (default hostname);
        outcome_timeout: seconds to wait for a version's outcome; tls: (cert, key, ca) PEM paths
            (default ``$WSYNC_TLS_CERT``, ``$WSYNC_TLS_KEY``, ``$WSYNC_TLS_CA``).
    """

    def __init__(self, coordinator: Optional[str] = None, model: Any = None,
                 rank: Optional[int] = None, ranks: Optional[int] = None,
                 transport: str = "shared-memory", token: Optional[str] = None,
                 model_id: str = "model", options: Optional[Mapping] = None,
                 node: Optional[str] = None, outcome_timeout: float = 90.0,
                 tls: Optional[Sequence[str]] = None) -> None:
        host, port = _address(coordinator)
        self.rank = launch_rank() if rank is None else int(rank)
        self.ranks = launch_world_size() if ranks is None else int(ranks)
        if not 0 <= self.rank < self.ranks:
            raise InvalidArgumentError(f"rank: {self.rank} is not in [0, {self.ranks})")
        self.model = model
        self.model_id = model_id
        self._handle = _interruptible(
            _wsync.TrainerRank, host, port, _token(token), self.rank, self.ranks, _node(node),
            transport, options_text(options), model_id,
            int(outcome_timeout * 1000), _tls(tls), abandoned=_close_handle)
        self._pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._pool_lock = threading.Lock()
        self._last_async: Optional[concurrent.futures.Future] = None
        # The core's trainer rank takes one caller at a time: a publish left running by Ctrl-C,
        # or one in the pool, and the next one never overlap.
        self._calling = threading.Lock()
        _open_ranks.add(self)

    def _shard(self, source: Any) -> List[Tuple[str, torch.Tensor]]:
        pairs = _torch.named_tensors(source)
        return [p for i, p in enumerate(pairs) if i % self.ranks == self.rank]

    def publish(self, model: Any = None, weight_version: Optional[int] = None,
                metadata: Optional[Mapping[str, Any]] = None) -> UpdateOutcome:
        """Publishes this rank's shard of `model` (default: the constructor's) as
        `weight_version` and waits for the version's outcome (committed, or aborted with the
        reason and the per-rank table). Raises WeightSyncError only when the publish itself
        failed (e.g. VersionNotMonotonicError)."""
        call = self._prepare(model, weight_version, metadata)
        queued = self._last_async
        if queued is not None:  # in call order: after the publish_async calls made before
            _interruptible(concurrent.futures.wait, [queued])
        return self._publish_prepared(call)

    def _prepare(self, model: Any, weight_version: Optional[int],
                 metadata: Optional[Mapping[str, Any]]) -> Any:
        """The C++ publish of this rank's shard, ready to call: built on the caller's thread, so
        CUDA tensors are read after the work queued on the caller's current stream."""
        if weight_version is None:
            raise InvalidArgumentError("publish: field weight_version: required")
        source = self.model if model is None else model
        if source is None:
            raise InvalidArgumentError("publish: no model given here or to TrainerRank()")
        handle = _open_handle(self._handle, "TrainerRank", self.rank)
        tuples, keep = _torch.publish_sources(self._shard(source))
        version, meta = int(weight_version), encode_metadata(metadata)
        calling = self._calling

        def call():
            # Holds `keep` (the contiguous copies the tuples point into) for as long as the C++
            # publish runs, even when Ctrl-C left this frame early.
            with calling:
                return handle.publish(tuples, version, meta) if keep is not None else None

        return call

    @staticmethod
    def _publish_prepared(call: Any) -> UpdateOutcome:
        raw = _interruptible(call)
        if raw["error"] and not raw["outcome_json"]:
            raise error_for(raw["error_code"] or "io_error", raw["error"])
        return UpdateOutcome(raw)

    def publish_async(self, model: Any = None, weight_version: Optional[int] = None,
                      metadata: Optional[Mapping[str, Any]] = None
                      ) -> "concurrent.futures.Future[UpdateOutcome]":
        """:meth:`publish` in a background thread (one at a time, in call order); the tensors
        must not change until the future is done. They are taken here, on the caller's thread
        (CUDA tensors: after the work queued on its current stream), so a bad argument raises
        here rather than through the future."""
        call = self._prepare(model, weight_version, metadata)  # here: the caller's stream
        with self._pool_lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    1, thread_name_prefix="wsync-pub")
            future = self._pool.submit(self._publish_prepared, call)
            self._last_async = future
        return future

    def held_versions(self) -> List[int]:
        """The versions whose memory this rank still holds, ascending: each is given back when
        the coordinator says no rollout rank holds it any more (a restarted coordinator does so
        once the ranks had time to rejoin). Safe to call while a publish runs."""
        return list(_open_handle(self._handle, "trainer", self.rank).held_versions())

    def close(self) -> None:
        """Leaves the cluster."""
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        if self._handle is not None:
            self._handle.close()
            self._handle = None

    def __enter__(self) -> "TrainerRank":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class RolloutRank(_Gate):
    """A rollout rank joined to a wsync coordinator that keeps a torch module on the newest
    committed version, in the background.

    Every update the coordinator sends is imported, verified, checked against the module
    (names, shapes, dtypes), copied into a spare set of tensors and switched in by reference
    under the generation gate; the rank then acknowledges. Readers wrap each forward pass in
    ``with rank.generating():`` and so never see a half-updated module; they wait only for the
    switch. A failed update is rejected and the module keeps its version.

    Args:
        coordinator, token, node, tls, options, transport: as for :class:`TrainerRank`.
        model: the ``torch.nn.Module`` to keep updated (its state_dict names must match the
            trainer's).
        rank: this consumer rank (default from torchrun / Slurm).
        model_id: the model's name in the cluster (default ``"model"``).
        verify: recompute checksums before installing (default on).
        join_timeout: seconds to wait for the coordinator to accept the rank.
    """

    def __init__(self, coordinator: Optional[str] = None, model: Optional[torch.nn.Module] = None,
                 rank: Optional[int] = None, transport: str = "shared-memory",
                 token: Optional[str] = None, model_id: str = "model",
                 options: Optional[Mapping] = None, node: Optional[str] = None,
                 verify: bool = True, join_timeout: float = 10.0,
                 tls: Optional[Sequence[str]] = None) -> None:
        if model is None:
            raise InvalidArgumentError("RolloutRank: field model: a torch.nn.Module is required")
        host, port = _address(coordinator)
        self.rank = launch_rank() if rank is None else int(rank)
        self.model = model
        self.installer = ModuleInstaller(model)
        self.installer.rank = self.rank  # install errors name this rank, not -1
        self._handle = _interruptible(
            _wsync.RolloutRank, host, port, _token(token), self.rank, _node(node), transport,
            options_text(options), model_id, bool(verify),
            int(join_timeout * 1000), _tls(tls), self.installer, abandoned=_close_handle)
        _open_ranks.add(self)

    @property
    def active_weight_version(self) -> int:
        """The version readers see now; 0 before the first install."""
        handle = self._handle  # once: close() on another thread may clear it meanwhile
        return handle.active_version() if handle is not None else 0

    def status(self) -> dict:
        """What the rank did: active_weight_version, joined, updates / installed / rejected
        counts, the last update (version, error, import/verify/install seconds), and
        longest_gate_wait_s (the longest a generation step waited for an install)."""
        return _open_handle(self._handle, "RolloutRank", self.rank).status()

    def wait_for_version(self, version: int, timeout: float = 60.0) -> int:
        """Blocks until the active version is at least `version`; returns it. Not from inside
        this thread's ``with generating():`` block: the install it waits for waits for that
        block to end."""
        self._not_generating("RolloutRank.wait_for_version")
        deadline = time.monotonic() + timeout
        while self.active_weight_version < version:
            _open_handle(self._handle, "RolloutRank", self.rank)  # closed: no version will come
            if time.monotonic() > deadline:
                raise WeightSyncTimeoutError(
                    f"rank {self.rank}: version {version} not active within {timeout} s "
                    f"(active {self.active_weight_version}; last update: "
                    f"{self.status().get('last_update')})")
            time.sleep(0.005)
        return self.active_weight_version

    def reset_longest_wait(self) -> None:
        """Starts a new measurement of the longest gate wait."""
        _open_handle(self._handle, "RolloutRank", self.rank).reset_longest_wait()

    def close(self) -> None:
        """Leaves the cluster; the module keeps the version it has."""
        self._not_generating("RolloutRank.close")
        if self._handle is not None:
            self._handle.close()
            self._handle = None

    def __enter__(self) -> "RolloutRank":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
