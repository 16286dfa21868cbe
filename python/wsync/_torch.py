"""Torch tensors in and out of wsync: dtype names, publish sources, zero-copy views.

Views: ``torch.frombuffer`` over the imported segment (read-only bytes, a ``Segment`` object that
holds its update's memory; in CUDA memory a ``DeviceSegment``, viewed through
``__cuda_array_interface__``), then a slice, a dtype view and a shape view per tensor. Torch keeps
the segment object alive as long as any tensor made from it, so the bytes stay mapped until the
last view goes (see :mod:`wsync._bridge` for what that means for ``release``).
"""

import contextlib
import warnings
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Tuple

import torch

from wsync import _wsync
from wsync._errors import InvalidArgumentError

# The core's dtype table (wire name -> torch attribute name), resolved against this torch.
_TORCH_TO_WSYNC = {}
for _wire in _wsync.dtype_names():
    _dt = getattr(torch, _wsync.dtype_torch_name(_wire), None)
    if isinstance(_dt, torch.dtype):
        _TORCH_TO_WSYNC[_dt] = _wire

_WSYNC_TO_TORCH = {wire: dt for dt, wire in _TORCH_TO_WSYNC.items()}
# A torch without float8 types (before 2.1) gets fp8 tensors as their raw bytes.
for _wire in _wsync.dtype_names():
    _WSYNC_TO_TORCH.setdefault(_wire, torch.uint8)


_ITEMSIZE = {dt: torch.tensor([], dtype=dt).element_size() for dt in set(_WSYNC_TO_TORCH.values())}


def wire_dtype(name: str, t: torch.Tensor) -> str:
    """The wire name of a tensor's dtype, or InvalidArgumentError naming the tensor."""
    try:
        return _TORCH_TO_WSYNC[t.dtype]
    except KeyError:
        raise InvalidArgumentError(
            f"tensor {name}: field dtype: wsync cannot carry {t.dtype}; it carries "
            + ", ".join(str(d) for d in _TORCH_TO_WSYNC)
        ) from None


def torch_dtype(wire: str) -> torch.dtype:
    """The torch dtype for a wire dtype name."""
    return _WSYNC_TO_TORCH[wire]


def named_tensors(source: Any) -> List[Tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of an nn.Module (its state_dict), a mapping or an iterable of pairs."""
    if isinstance(source, torch.nn.Module):
        items: Iterable = source.state_dict().items()
    elif isinstance(source, Mapping):
        items = source.items()
    else:
        items = source
    out = []
    seen = set()
    for pair in items:
        try:
            name, t = pair
        except (TypeError, ValueError):
            raise InvalidArgumentError(
                "publish: expects an nn.Module, a state dict or an iterable of (name, tensor) "
                f"pairs, got an item {type(pair).__name__}"
            ) from None
        if not isinstance(name, str) or not name:
            raise InvalidArgumentError(f"publish: field name: tensor names must be non-empty str, "
                                       f"got {name!r}")
        if not isinstance(t, torch.Tensor):
            raise InvalidArgumentError(f"tensor {name}: expected a torch.Tensor, got "
                                       f"{type(t).__name__}")
        if name in seen:
            raise InvalidArgumentError(f"tensor {name}: field name: appears twice")
        seen.add(name)
        out.append((name, t))
    return out


def publish_sources(pairs: List[Tuple[str, torch.Tensor]]) -> Tuple[list, list]:
    """The extension's tensor tuples and the tensors that back them (keep those alive).

    Non-contiguous tensors are made contiguous (one copy each). CUDA tensors travel as device
    pointers with their device and a stream that waits for the work queued on that device's
    current stream by now (this call): the publisher's copies (device-to-device into a CUDA
    transport's slots, device-to-host into a host transport's segments) wait for that stream,
    and the publish returns once they are done. Work the caller queues after this call is not
    waited for, so a publish that runs later (publish_async) overlaps the next step. Other
    devices (mps, xla, meta) are refused.
    """
    tuples = []
    keep: list = []
    marks = {}  # device -> a stream standing for "the current stream's work as of now"
    for name, t in pairs:
        if t.device.type not in ("cpu", "cuda"):
            raise InvalidArgumentError(
                f"tensor {name}: field device: {t.device}: wsync publishes CPU and CUDA tensors; "
                "move it to one of those first"
            )
        if t.layout != torch.strided:
            raise InvalidArgumentError(
                f"tensor {name}: field layout: {t.layout}: wsync publishes dense tensors; "
                "call .to_dense() first")
        wire = wire_dtype(name, t)
        try:
            t = t.detach()
            if not t.is_contiguous():
                t = t.contiguous()  # on a CUDA tensor: queued on the current stream (see below)
            pointer = t.data_ptr()
        except RuntimeError as e:  # no storage of its own: a DTensor shard, a functional tensor
            raise InvalidArgumentError(
                f"tensor {name}: field data: {e} (a distributed tensor is published by the rank "
                "holding it, as a local tensor: .to_local() or .full_tensor())") from e
        keep.append(t)
        fields = (name, wire, list(t.shape), pointer, t.numel() * t.element_size())
        if t.device.type == "cuda":
            device = cuda_index(t)
            if device not in marks:
                mark = torch.cuda.Stream(device)
                mark.wait_stream(torch.cuda.current_stream(device))
                marks[device] = mark
                keep.append(mark)  # the stream lives as long as the publish that waits on it
            fields += (device, marks[device].cuda_stream)
        tuples.append(fields)
    return tuples, keep


def _contiguous_strides(shape) -> list:
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * max(int(shape[i + 1]), 1)
    return strides


@contextlib.contextmanager
def device_kept() -> Iterator[None]:
    """Gives the calling thread torch's current CUDA device back after a call into the core,
    which makes current each device it works on (a copy from cuda:1 into a slot on cuda:0
    leaves cuda:0 current). Nothing to keep while torch has not touched CUDA."""
    if not (torch.cuda.is_initialized() and torch.cuda.is_available()):
        yield
        return
    before = torch.cuda.current_device()
    try:
        yield
    finally:
        # After a sticky CUDA error these raise too; the core's own error is the one to see.
        with contextlib.suppress(RuntimeError):
            if torch.cuda.current_device() != before:
                torch.cuda.set_device(before)


def cuda_index(t: torch.Tensor) -> int:
    """The CUDA device index of `t`, or -1 for a CPU tensor."""
    if t.device.type != "cuda":
        return -1
    return t.device.index if t.device.index is not None else torch.cuda.current_device()


def copy_bytes(dest: torch.Tensor, segment: Any, offset: int, nbytes: int) -> None:
    """Copies `nbytes` of a host segment, from `offset`, into contiguous `dest` (CPU or CUDA)
    with torch: after the work queued on torch's current stream, done when this returns."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only bytes, read only
        src = torch.frombuffer(segment, dtype=torch.uint8, count=nbytes, offset=offset)
    dest.reshape(-1).view(torch.uint8).copy_(src)


def _segment_base(s: Any, manifest: Any) -> torch.Tensor:
    """One segment as a flat uint8 tensor, without a copy: host bytes through the buffer
    protocol, device bytes through __cuda_array_interface__ (torch holds the segment object,
    and with it the update's memory, while the tensor lives)."""
    if isinstance(s, _wsync.DeviceSegment):
        if not torch.cuda.is_available():
            raise InvalidArgumentError(
                f"import: the update is in cuda:{s.device} memory and this torch has no CUDA "
                f"(update_id={manifest.update_id})")
        return torch.as_tensor(s, device=f"cuda:{s.device}")
    return torch.frombuffer(s, dtype=torch.uint8)


def views_of(manifest: Any, segments: list, out: Dict[str, torch.Tensor]) -> None:
    """Adds the manifest's tensors to `out` as views of `segments` (no copy), on the CPU or on
    the CUDA device the update lives on.

    Each segment is viewed once per dtype it holds; each tensor is then one as_strided of that
    view (tensors are 256-byte aligned, so every offset is a whole number of elements)."""
    with warnings.catch_warnings():
        # The segments are read-only on purpose; torch warns that it has no read-only tensors.
        warnings.simplefilter("ignore", UserWarning)
        bases = [_segment_base(s, manifest) if len(s) else None for s in segments]
    device = next((f"cuda:{s.device}" for s in segments if isinstance(s, _wsync.DeviceSegment)),
                  "cpu")
    typed: Dict[tuple, torch.Tensor] = {}
    for name, wire, shape, strides, segment, offset, nbytes in manifest.view_plan():
        dt = _WSYNC_TO_TORCH[wire]
        if nbytes == 0:
            out[name] = torch.empty(shape, dtype=dt, device=device)
            continue
        base = typed.get((segment, dt))
        if base is None:
            raw = bases[segment]
            size = _ITEMSIZE[dt]
            base = typed[(segment, dt)] = raw[:raw.numel() - raw.numel() % size].view(dt)
        out[name] = base.as_strided(shape, strides or _contiguous_strides(shape),
                                    offset // _ITEMSIZE[dt])
