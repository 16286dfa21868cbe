"""wsync as a vLLM weight-transfer backend, named ``"wsync"``.

vLLM moves trainer weights into its workers through a pluggable engine pair (see vLLM's
``vllm/distributed/weight_transfer/``): a worker-side engine that vLLM builds from
``WeightTransferConfig(backend=...)`` and drives through the four phases (init, start, update,
finish), and a trainer-side engine built by ``WeightTransferTrainerFactory.trainer_init`` that
drives those phases through a client. This module gives both for wsync:

- :class:`WsyncTrainerEngine` publishes the trainer's weights through a wsync bridge
  (:func:`wsync.make_weight_bridge`) and sends ``update_info = {"manifest": <Manifest JSON>,
  "names": [...], "dtype_names": [...], "shapes": [...]}`` through its client: a
  :class:`wsync.http_client.VLLMHTTPClient` (to a vLLM server, or to a wsync consumer that speaks
  the same routes), or any object with vLLM's client methods.
- :class:`WsyncWeightTransferEngine` imports each manifest through its own bridge, verifies the
  checksums before anything is loaded, calls ``load_weights`` with the tensors in manifest
  order, then acknowledges and releases the update.

Bytes travel through wsync's transports (shared memory, file-mmap, ...), never through the HTTP
body: only the manifest does.

Usage, trainer side (vLLM >= 0.26 has trainer engines)::

    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.base import ModuleSource
    import wsync.vllm  # registers "wsync"

    engine = WeightTransferTrainerFactory.trainer_init(
        "wsync", config, {"rank": 0, "transport": "shared-memory"},
        client=VLLMHTTPClient("http://127.0.0.1:8000"), source=ModuleSource(model))
    engine.send_weights()          # start -> update -> finish, one version per call

Worker side: the worker processes must import this module (or call :func:`register`) before vLLM
builds the engine, e.g. through vLLM's ``vllm.general_plugins`` entry point pointing at
``wsync.vllm:register``; then serve with ``--weight-transfer-config '{"backend": "wsync"}'``.

vLLM's engine interface changed across releases; the worker engine accepts each form it has
had: ``__init__(config, parallel_config)`` (up to about v0.24) and ``__init__(config,
vllm_config, device, model)`` (v0.25+); ``receive_weights(update_info, load_weights)`` and
``receive_weights(update_info)`` (loading into ``self.model``); ``start_weight_update()`` with or
without ``is_checkpoint_format``. Without a start, each ``receive_weights`` is a whole update.
"""

import importlib.util
import warnings
from typing import Any, Dict, Optional

from wsync._vllm_common import (BACKEND, WsyncInitInfo, WsyncTrainerInitInfo,
                                WsyncUpdateInfo)
from wsync._vllm_trainer import WsyncTrainerEngine
from wsync._vllm_worker import WsyncWeightTransferEngine

__all__ = [
    "BACKEND",
    "WsyncInitInfo",
    "WsyncUpdateInfo",
    "WsyncTrainerInitInfo",
    "WsyncWeightTransferEngine",
    "WsyncTrainerEngine",
    "register",
]


def _registry_has(factory: Any, name: str) -> bool:
    return name in getattr(factory, "_registry", {})


def _with_base(ours: type, base: Optional[type]) -> type:
    """Our class, made a subclass of vLLM's base where that works (isinstance checks pass);
    our methods come first."""
    if base is None:
        return ours
    try:
        import types

        return types.new_class(ours.__name__, (ours, base), {},
                               lambda ns: ns.update({"__module__": __name__,
                                                     "__doc__": ours.__doc__}))
    except TypeError:
        return ours


def register() -> Dict[str, type]:
    """Registers the ``"wsync"`` backend with vLLM's engine factories (worker side, and
    trainer side where this vLLM has trainer engines). Safe to call more than once.

    Returns:
        The registered classes under ``"worker"`` and ``"trainer"``.

    Raises:
        ImportError: vLLM, or its weight-transfer factory, is not importable.
    """
    from vllm.distributed.weight_transfer import factory

    try:
        from vllm.distributed.weight_transfer import base
    except ImportError:  # pragma: no cover - every vLLM with a factory has a base
        base = None
    out: Dict[str, type] = {}
    worker = _with_base(WsyncWeightTransferEngine, getattr(base, "WeightTransferEngine", None))
    if not _registry_has(factory.WeightTransferEngineFactory, BACKEND):
        factory.WeightTransferEngineFactory.register_engine(BACKEND, worker)
    out["worker"] = worker
    trainer_factory = getattr(factory, "WeightTransferTrainerFactory", None)
    if trainer_factory is not None:
        trainer = _with_base(WsyncTrainerEngine,
                             getattr(base, "TrainerWeightTransferEngine", None))
        if not _registry_has(trainer_factory, BACKEND):
            trainer_factory.register_engine(BACKEND, trainer)
        out["trainer"] = trainer
    return out


if importlib.util.find_spec("vllm") is not None:
    try:
        register()
    except Exception as _e:  # an old vLLM without weight transfer: usable, not registered
        warnings.warn(f"wsync.vllm: not registered with vLLM: {_e}")
