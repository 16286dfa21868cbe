"""vLLM's trainer-side engine over wsync (see wsync.vllm)."""

import warnings
from typing import Any, Dict, Iterable, List, Optional, Tuple

from wsync._errors import (HTTPError, IllegalTransitionError, InvalidArgumentError,
                           TransportIOError, VersionNotMonotonicError, WeightSyncError,
                           WeightSyncTimeoutError)
from wsync._text import options_text
from wsync._vllm_common import (WsyncTrainerInitInfo, _detached, _from_dict, _make_bridge,
                                _update_info_of)


class WsyncTrainerEngine:
    """vLLM trainer-side engine: publishes the source's weights through wsync, one version per
    :meth:`send_weights`, and drives the worker's phases through the client.

    Built by :meth:`trainer_init` (vLLM's ``WeightTransferTrainerFactory.trainer_init("wsync",
    ...)``). Rank 0 publishes and calls the client; every other rank only iterates the source,
    keeping collectives such as FSDP's all-gather in step.

    The published bytes stay held until the next version is active on the workers (the active
    one may be read from the publisher's memory, as a wsync consumer does); :meth:`shutdown`
    releases what is left.
    """

    init_info_cls = WsyncTrainerInitInfo
    config_cls: Any = None  # vLLM's WeightTransferConfig; any object is kept as it is

    def __init__(self, config: Any, *, client: Any, source: Any, is_sender: bool = True,
                 init_info: Optional[WsyncTrainerInitInfo] = None) -> None:
        """Keeps the config, client and source; :meth:`trainer_init` is the way to build one.

        Args:
            config: vLLM's weight-transfer config (kept, not read).
            client: vLLM's ``VLLMWeightSyncClient`` (e.g. :class:`VLLMHTTPClient`): needs
                ``update_weights``; ``init_weight_transfer_engine``, ``start_weight_update`` and
                ``finish_weight_update`` are called where it has them.
            source: the weights: an iterable of ``(name, tensor)`` iterated afresh each round
                (vLLM's ``WeightSource``), or an ``nn.Module``.
            is_sender: whether this rank publishes and calls the client.
            init_info: the trainer init info.
        """
        if client is None or not callable(getattr(client, "update_weights", None)):
            raise InvalidArgumentError("client: must have update_weights(update_info)")
        self.config = config
        self.client = client
        self.source = source
        self.is_sender = is_sender
        self.init_info = init_info or WsyncTrainerInitInfo(rank=0 if is_sender else 1)
        self.bridge: Any = None
        self.weight_version = 0  # the last version the workers finished
        self._held: List[Any] = []  # manifests published and not released yet
        self._sent_version = 0  # the last version sent whose round ended without an answer

    @classmethod
    def trainer_init(cls, config: Any, init_info: Any, *, client: Any,
                     source: Any) -> "WsyncTrainerEngine":
        """Builds the engine; on rank 0 opens the bridge and initialises the workers.

        Args:
            config: vLLM's weight-transfer config.
            init_info: a :class:`WsyncTrainerInitInfo` or its dict (``rank`` required).
            client: see :meth:`__init__`.
            source: see :meth:`__init__`.

        Returns:
            The engine; :meth:`send_weights` may be called next.
        """
        info = _from_dict(cls.init_info_cls, init_info, "init_info")
        if not isinstance(info.rank, int) or info.rank < 0:
            raise InvalidArgumentError(f"init_info.rank: must be an int >= 0, not {info.rank!r}")
        if not isinstance(info.first_version, int) or info.first_version < 1:
            raise InvalidArgumentError("init_info.first_version: must be an int >= 1")
        if source is None:
            raise InvalidArgumentError("source: missing")
        options = options_text(info.transport_options, "init_info.transport_options")
        engine = cls(config, client=client, source=source, is_sender=info.rank == 0,
                     init_info=info)
        engine.weight_version = info.first_version - 1
        if engine.is_sender:
            engine.bridge = _make_bridge(info.transport, source_worker="trainer",
                                         source_rank=info.rank, model_id=info.model_id,
                                         options=options)
            # The bridge's name, not an alias: manifests carry it, and workers compare with it.
            worker_info: Dict[str, Any] = {"transport": engine.bridge.transport}
            if options:
                worker_info["transport_options"] = options
            init = getattr(client, "init_weight_transfer_engine", None)
            if callable(init):
                init(worker_info)
        return engine

    def send_weights(self, weight_version: Optional[int] = None) -> Any:
        """One round: publish the source as the next version, then start, update and finish on
        the workers.

        Args:
            weight_version: the version to publish; default one above the last.

        Returns:
            The published Manifest on rank 0, ``None`` on the other ranks. When the worker
            refuses the round, the new version is released and the previous one stays held (and
            active on the worker); a worker whose update call failed may still be mid-update, as
            with vLLM's own engines (a wsync consumer then refuses the next start with 409 until
            an update is finished). When the round ends without an answer (a timeout, a lost
            connection, a 5xx, an interrupt), the worker may serve the new version: it stays
            held too, and the next round takes the version above it. That round starts first,
            and, where the client has ``status()`` (:class:`VLLMHTTPClient`), releases whichever
            of the two the worker does not serve.
        """
        last = max(self.weight_version, self._sent_version)
        version = last + 1 if weight_version is None else int(weight_version)
        if version <= last:
            raise VersionNotMonotonicError(
                f"send_weights: weight_version must increase monotonically: {version} is not "
                f"above {last}" + (" (sent earlier without an answer)"
                                   if last > self.weight_version else ""))
        if not self.is_sender:
            for _ in _pairs(self.source):
                pass
            self.weight_version = version
            return None
        if self.bridge is None:
            raise IllegalTransitionError("send_weights: the engine is shut down")
        pairs = _detached(_pairs(self.source))
        if self.init_info.copy_to_cpu:
            pairs = ((name, t.cpu()) for name, t in pairs)
        start = getattr(self.client, "start_weight_update", None)
        finish = getattr(self.client, "finish_weight_update", None)
        started = False
        if len(self._held) > 1 and callable(start):
            # A round went unanswered, so two versions are held, and this one may need the slot
            # of one of them. Once a start is accepted no install runs on the worker, and its
            # status (where the client can ask) says which version it serves.
            start()
            started = True
            self._settle()
        try:
            manifest = self.bridge.publish(pairs, version, metadata=self.init_info.metadata)
        except BaseException:
            if started and callable(finish):
                try:
                    finish()  # nothing came: the worker drops the empty update, the phase ends
                except WeightSyncError:
                    pass
            raise
        sent = False
        try:
            if callable(start) and not started:
                start()
            sent = True
            self.client.update_weights(_update_info_of(manifest))
            if callable(finish):
                finish()
        except BaseException as e:
            if sent and not _refused(e):
                # No answer (a timeout, a lost connection, an interrupt): the workers may be
                # installing it, or serve it already. Its memory stays held until a later
                # round is active, and that round takes the next version.
                self._held.append(manifest)
                self._sent_version = max(self._sent_version, version)
            else:
                self._release(manifest)
            raise
        # The workers run `version` now, whatever becomes of the old versions' releases.
        previous, self._held = self._held, [manifest]
        self.weight_version = version
        for old in previous:
            self._release(old)
        return manifest

    def shutdown(self) -> None:
        """Releases every held version and drops the bridge."""
        held, self._held = self._held, []
        for manifest in held:
            self._release(manifest)
        self.bridge = None

    def _settle(self) -> None:
        """Releases the held versions other than the one the worker serves, when its status
        names one of them."""
        status = getattr(self.client, "status", None)
        if not callable(status):
            return
        try:
            active = status().get("active_weight_version")
        except (WeightSyncError, AttributeError):
            return
        keep = [m for m in self._held if m.weight_version == active]
        if not isinstance(active, int) or len(keep) != 1:
            return
        for manifest in self._held:
            if manifest is not keep[0]:
                self._release(manifest)
        self._held = keep
        self.weight_version = max(self.weight_version, active)

    def _release(self, manifest: Any) -> None:
        # Never hides the error being raised, nor stops a shutdown: a failed release is warned.
        try:
            self.bridge.release(manifest.update_id)
        except WeightSyncError as e:
            warnings.warn(f"wsync: release of {manifest.update_id} failed: {e}")


def _refused(e: BaseException) -> bool:
    """Whether the worker answered the round with a refusal (it then serves the version it had):
    its own error, or an HTTP answer below 500. A timeout, a lost connection, a 5xx or an
    interrupt leaves open whether it installed."""
    if isinstance(e, HTTPError):
        return e.status < 500
    return isinstance(e, WeightSyncError) and not isinstance(
        e, (WeightSyncTimeoutError, TransportIOError))


def _pairs(source: Any) -> Iterable[Tuple[str, Any]]:
    """A fresh pass over the source: an nn.Module's named parameters, or the source itself."""
    named = getattr(source, "named_parameters", None)
    if callable(named) and not hasattr(source, "metadata"):
        return named()
    return iter(source)
