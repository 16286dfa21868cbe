"""Bridges: publish a model's tensors as a versioned update, import one as zero-copy tensors,
and walk it through acknowledge / reject / release. Plus the rollout executor.

Lifetime of imported tensors: they view the imported memory itself. Releasing an update (by its
consumer, or by a publisher in the same process) while some of its tensors are still referenced
does not unmap or recycle that memory: the release waits, in the background, until the last
tensor is dropped, and happens then. So a tensor never reads another version's bytes or freed
memory; keep tensors only as long as you need them (``releases_pending()`` lists the updates
whose release is waiting). Treat the tensors as read-only: shared-memory and file-mmap map the
bytes read-only (a write faults); local-clone imports a private copy, so a write there changes
only this consumer's copy, after its checksums were verified; cuda-ipc and cuda-vmm map the
publisher's device memory writable, so a write there changes what every consumer reads.
"""

import threading
from contextlib import contextmanager, suppress
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Union

import torch

from wsync import _torch
from wsync import _wsync
from wsync._errors import (IllegalTransitionError, InvalidArgumentError, UnknownUpdateError,
                           WeightSyncError, error_for)
from wsync._install import ModuleInstaller, ViewInstaller
from wsync._text import encode_metadata, options_text

Manifest = _wsync.Manifest

_MiB = 1 << 20


class WeightBridge:
    """One side (or both) of the weight-sync protocol over one wsync transport.

    A trainer publishes with it; a rollout worker imports with it. The two halves are made on
    first use, so one object can serve either role (or both, in tests).

    Args:
        transport: registry name: ``"shared-memory"`` (processes on one host), ``"local-clone"``
            (one process), ``"file-mmap"`` (a shared directory: ``options={"dir": ...}``),
            ``"ucx"`` (across hosts). :func:`wsync.transports` lists what this build has.
        source_worker: the publisher's name in manifests (default ``"<host>:<pid>"``).
        source_rank: the publisher rank of this trainer; for a consumer, its rank.
        model_id: the model the updates belong to (default "model").
        options: transport options as text (``{"dir": "/shared/w"}``).
        max_segment_bytes, copy_threads, slot_wait_s: publisher tuning.
        checksum_chunk_bytes: 0 (default) checksums whole tensors (xxh3-64); a power of two from
            4096 to 2**30 checksums each piece of that size (xxh3-64-chunked), so consumers
            verify one large tensor on several threads.
        verify_threads: threads that recompute checksums on import.
    """

    def __init__(self, transport: str = "shared-memory", source_worker: Optional[str] = None,
                 source_rank: int = 0, model_id: str = "model", options: Optional[Mapping] = None,
                 max_segment_bytes: int = 256 * _MiB, copy_threads: int = 2,
                 slot_wait_s: float = 10.0, verify_threads: int = 2,
                 checksum_chunk_bytes: int = 0) -> None:
        self.transport = transport
        self.source_worker = source_worker or ""
        self.source_rank = int(source_rank)
        self.model_id = model_id
        self.options = options_text(options)
        self._publisher_args = (int(max_segment_bytes), int(copy_threads),
                                int(slot_wait_s * 1000), int(checksum_chunk_bytes))
        self._verify_threads = int(verify_threads)
        self._publisher = None
        self._consumer = None
        self._publishing = threading.Lock()  # one publish at a time: see publish's cleanup
        self._making = threading.Lock()  # each half made once, whichever thread comes first
        if transport not in _wsync.transports():
            raise error_for("unknown_transport",
                            f"unknown transport '{transport}'; this build has: "
                            + ", ".join(_wsync.transports()))

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(transport={self.transport!r}, "
                f"source_rank={self.source_rank})")

    # --- the publisher side -------------------------------------------------------------

    # A half made twice would lose one: the publisher that lost releases what it published as it
    # goes, under a manifest already returned.
    def _publisher_half(self):
        with self._making:
            if self._publisher is None:
                seg, threads, wait_ms, chunk = self._publisher_args
                self._publisher = _wsync.Publisher(self.transport, self.options, self.model_id,
                                                   self.source_worker, self.source_rank, seg,
                                                   threads, wait_ms, chunk)
            return self._publisher

    def publish(self, source: Any, weight_version: int,
                metadata: Optional[Mapping[str, Any]] = None) -> Manifest:
        """Publishes one complete, versioned update and returns its manifest.

        Args:
            source: an ``nn.Module`` (its ``state_dict()``), a state dict, or an iterable of
                ``(name, tensor)``; CPU or CUDA tensors of any dtype wsync carries (f64, f32,
                f16, bf16, fp8, i64..i8, u8, bool). Non-contiguous tensors are copied contiguous
                first. CUDA tensors are read on their device after the work queued on its
                current stream.
            weight_version: must grow with every publish ("weight_version must increase
                monotonically" otherwise); the last version may be published again (a retry,
                with a new update_id) once its publication was released.
            metadata: extra key/values for the manifest; non-str values travel as JSON text.

        The bytes stay published until :meth:`release` with the manifest's update_id.
        """
        pairs = _torch.named_tensors(source)
        if not pairs:
            raise InvalidArgumentError("publish: field tensors: nothing to publish")
        tuples, keep = _torch.publish_sources(pairs)
        publisher = self._publisher_half()
        with self._publishing:
            held_before = set(publisher.held())
            try:
                with _torch.device_kept():
                    m = publisher.publish(tuples, int(weight_version), [],
                                          encode_metadata(metadata))
            except BaseException:
                # Ctrl-C lands as the call returns, before its manifest reaches the caller, who
                # then could never release it: give back what this call published.
                for update_id in set(publisher.held()) - held_before:
                    with suppress(WeightSyncError):
                        publisher.release(update_id)
                raise
        del keep
        return m

    # --- the consumer side --------------------------------------------------------------

    def _consumer_half(self):
        with self._making:
            if self._consumer is None:
                self._consumer = _wsync.Consumer(self.transport, self.options, self.source_rank,
                                                 self._verify_threads)
            return self._consumer

    def import_update(self, manifest: Manifest, verify: bool = True) -> Dict[str, torch.Tensor]:
        """Imports an update: a dict of name -> read-only tensor viewing the imported memory (no
        copy), in manifest order. With ``verify`` (default) every checksum is recomputed first:
        a difference raises ChecksumMismatchError ("tensor checksum mismatch") and the update is
        rejected. The tensors keep the memory alive (see the module's note on lifetime)."""
        c = self._consumer_half()
        out: Dict[str, torch.Tensor] = {}
        segments = None
        try:
            with _torch.device_kept():
                segments = c.import_update(manifest)
            if verify:
                with _torch.device_kept():
                    c.verify(manifest.update_id)
            _torch.views_of(manifest, segments, out)
        except BaseException as e:
            # A mismatch, no views (a torch without CUDA), or Ctrl-C once the core returned
            # (even from the import itself: it surfaces when the call returns): the update is
            # rejected with the reason and its bytes given back, so the slot is free for a
            # retry. An import that failed left nothing to give back. The first error is the
            # one raised.
            out.clear()
            imported = segments is not None
            del segments
            if not imported and not isinstance(e, KeyboardInterrupt):
                raise
            with suppress(WeightSyncError), _torch.device_kept():
                c.reject(manifest.update_id, str(e) or type(e).__name__)
            with suppress(WeightSyncError), _torch.device_kept():
                c.release(manifest.update_id)
            raise
        return out

    def acknowledge(self, update_id: str) -> None:
        """Says the update is installed in full. Raises IllegalTransitionError before a
        successful import ("cannot acknowledge update before import_update succeeds")."""
        c = self._consumer_half()
        try:
            state = c.state(update_id)
        except UnknownUpdateError:
            raise IllegalTransitionError(
                f"cannot acknowledge update before import_update succeeds "
                f"(update_id={update_id} rank={self.source_rank})") from None
        if state in ("imported", "verified"):
            c.mark_installed(update_id)
        c.acknowledge(update_id)

    def reject(self, update_id: str, reason: str) -> None:
        """Records that installing the update failed, and why."""
        self._consumer_half().reject(update_id, str(reason))

    def state(self, update_id: str) -> str:
        """The consumer-side lifecycle state of an update ("imported", "acknowledged", ...)."""
        return self._consumer_half().state(update_id)

    def release(self, update_id: str) -> None:
        """Drops this side's hold on an update: the consumer's import and/or the publisher's
        memory. Waits for nothing: while tensors of the update are alive in this process the
        memory stays, and goes with the last of them."""
        done = False
        consumer_error: Optional[Exception] = None
        if self._consumer is not None:
            try:
                with _torch.device_kept():
                    self._consumer.release(update_id)
                done = True
            except UnknownUpdateError:
                pass
            except Exception as e:  # e.g. released by an executor already: the publisher's
                consumer_error = e  # half must still go back, or its slot stays taken
        if self._publisher is not None and update_id in self._publisher.held():
            with _torch.device_kept():
                self._publisher.release(update_id)
            done = True
        if consumer_error is not None and not done:
            raise consumer_error
        if not done:
            raise UnknownUpdateError(f"unknown update_id: release: {update_id} is neither "
                                     f"imported nor published by this bridge "
                                     f"(update_id={update_id} rank={self.source_rank})")

    def close(self) -> None:
        """Releases everything this bridge still holds."""
        if self._publisher is not None:
            for uid in self._publisher.held():
                with _torch.device_kept():
                    self._publisher.release(uid)
        self._publisher = None
        self._consumer = None


class SharedMemoryTensorBridge(WeightBridge):
    """A bridge over POSIX shared memory: processes on one host, zero-copy import."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__("shared-memory", **kwargs)


class LocalCloneTensorBridge(WeightBridge):
    """A bridge inside one process (copies): the safest baseline for tests."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__("local-clone", **kwargs)


_ALIASES = {"local": "local-clone", "shm": "shared-memory", "shared_memory": "shared-memory",
            "local_clone": "local-clone", "file_mmap": "file-mmap"}


def canonical_transport(name: str) -> str:
    """The registry name of ``name``, which may be an alias (``"shm"``)."""
    return _ALIASES.get(name, name)


def make_weight_bridge(name: str, **kwargs: Any) -> WeightBridge:
    """A bridge over the transport `name` (``"local-clone"``, ``"shared-memory"``,
    ``"file-mmap"``, ``"ucx"``). Unknown names raise UnknownTransportError listing what this
    build has; the CUDA transports (``"cuda-ipc"``, ``"cuda-vmm"``, ``"nccl"``) are listed and
    raise BlockedError with the cause at the first publish or import where this machine cannot
    run them. CPU and CUDA tensors go to every transport; cuda-ipc and cuda-vmm import as CUDA
    tensors."""
    return WeightBridge(canonical_transport(name), **kwargs)


# Per thread, per gate (by id): [blocks open, the gate ticket they share].
_entered = threading.local()


class _Gate:
    """``with x.generating():`` for objects whose extension handle has gate_enter/gate_exit.

    The gate holds new steps back while an install waits for the steps in flight, and cannot
    tell a thread's second entry from another thread's: entered again by a thread already inside
    it, it would wait for itself, for ever and deaf to Ctrl-C (the wait is in C++). So blocks
    open on one thread share one hold (nested, or interleaved by generators or asyncio tasks on
    that thread), which ends when the last of them closes; and a call that waits for the steps
    in flight (an install, a release of the weights, closing) raises when made from a thread
    holding one."""

    _handle: Any

    def _holds(self) -> Dict[int, list]:
        if not hasattr(_entered, "holds"):
            _entered.holds = {}
        return _entered.holds

    def _not_generating(self, call: str) -> None:
        if id(self) in self._holds():
            raise IllegalTransitionError(
                f"{call}: called inside this thread's `with generating():` block; it waits for "
                "the generation steps in flight, this one included, so call it after the block")

    @contextmanager
    def generating(self) -> Iterator[float]:
        """Runs the block as one generation step: it sees one whole version from start to end;
        an install switches versions only between steps. Yields the seconds an install held it
        back (0.0 for a block opened while another is open on this thread: it shares that
        block's hold, which lasts until both are closed)."""
        holds, key = self._holds(), id(self)
        hold = holds.get(key)
        if hold is None:
            handle = self._handle
            if handle is None:
                raise IllegalTransitionError(
                    f"{type(self).__name__} rank {getattr(self, 'rank', '?')}: closed")
            # Leaves the gate when dropped, even on Ctrl-C here.
            hold = holds[key] = [0, handle.gate_enter()]
            waited = hold[1].waited
        else:
            waited = 0.0
        hold[0] += 1
        try:
            yield waited
        finally:
            hold[0] -= 1
            if hold[0] == 0:
                holds.pop(key, None)
                hold[1].exit()


class RolloutExecutor(_Gate):
    """The rollout side in one call: import, verify, install, activate, acknowledge, then release
    the previous update; on any failure reject, release the new update and keep the previous
    version active.

    Args:
        weight_bridge: the bridge to import with (its consumer side).
        model: a ``torch.nn.Module`` to install into (copied into a spare set of tensors, then
            switched by reference under the generation gate); None keeps the imported tensors
            themselves as the active weights (zero-copy).
        verify: recompute checksums before installing.
    """

    def __init__(self, weight_bridge: WeightBridge, model: Optional[torch.nn.Module] = None,
                 verify: bool = True) -> None:
        self.weight_bridge = weight_bridge
        self.installer = ModuleInstaller(model) if model is not None else ViewInstaller()
        self.installer.rank = weight_bridge.source_rank
        self._handle = _wsync.Executor(weight_bridge._consumer_half(), self.installer,
                                       bool(verify))
        self.last_report: Optional[dict] = None

    def update_weights(self, manifest: Union[Manifest, Sequence[Manifest]]
                       ) -> Dict[str, torch.Tensor]:
        """Installs one update (a manifest, or one per publisher rank of the same version) and
        returns the active tensors by name. Raises the failure's WeightSyncError subclass (the
        previous version stays active)."""
        self._not_generating("update_weights")
        shards = [manifest] if isinstance(manifest, Manifest) else list(manifest)
        with _torch.device_kept():
            r = self._handle.update_weights(shards)
        self.last_report = r
        if not r["acknowledged"]:
            raise error_for(r["error_code"] or "install_failed", r["error"] or "install failed")
        if isinstance(self.installer, ViewInstaller):
            return dict(self.installer.active)
        return dict(self.installer.targets)

    @property
    def active_weight_version(self) -> Optional[int]:
        """The version readers see; None before the first successful update."""
        return self._handle.active_version()

    def release_weights(self) -> List[str]:
        """Releases the imports the active weights still hold (at shutdown); returns their
        ids. Without a model the executor then shows no weights (``active_weight_version``
        None); a model keeps the copy it was given."""
        self._not_generating("release_weights")
        # The release waits for the steps in flight (it takes the gate); under it the installer
        # empties `active` and the version goes with it (python_adapter::deactivate).
        with _torch.device_kept():
            return self._handle.release_active()

    def longest_wait(self) -> float:
        """The longest a generation step waited at the gate so far (seconds)."""
        return self._handle.longest_wait()
