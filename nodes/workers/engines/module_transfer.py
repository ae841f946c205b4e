"""A decoder layer on the wire between two GPU ranks (CoCoServe's replicate and migrate): its weights,
and for a migration the keys and values of the sequences the moving copy served.

One message: an 8-byte header length, a JSON header (the layer, each tensor's name, dtype, shape and
offset, each sequence's KV, the padding) and the raw bytes. ``pad_bytes`` stretches the message to a
target model's layer (a Llama-2-13B decoder layer is 605 MB where the tiny model's is 3 MB): the time
on a shaped link is then the target's, labelled modeled by whoever asked for the padding.
"""

import json
import struct
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from nodes.inference.config import LlamaConfig
from nodes.inference.model import DecoderLayer

from .. import mpi_link

TAG_MODULE = 14  # module operations between GPU ranks
_HEADER = struct.Struct("<Q")


class LayerKV(NamedTuple):
    sequence: int
    keys: torch.Tensor  # [kv_heads, length, head_dim]
    values: torch.Tensor


class LayerMessage(NamedTuple):
    layer: int
    module: DecoderLayer
    kv: List[LayerKV]
    weight_bytes: int
    kv_bytes: int
    pad_bytes: int


def _raw(tensor: torch.Tensor) -> bytes:
    flat = tensor.detach().contiguous().cpu().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes()


def pack(header: Dict[str, Any], tensors: Sequence[Tuple[str, torch.Tensor]], pad_bytes: int = 0) -> bytearray:
    """One message: ``header`` (JSON) and ``tensors`` by name, raw, then ``pad_bytes`` of zeros."""
    body: List[bytes] = []
    entries: List[List[Any]] = []
    offset = 0
    for name, tensor in tensors:
        raw = _raw(tensor)
        entries.append([name, str(tensor.dtype).replace("torch.", ""), list(tensor.shape), offset, len(raw)])
        body.append(raw)
        offset += len(raw)
    text = json.dumps(dict(header, tensors=entries, pad=pad_bytes)).encode()
    message = bytearray(_HEADER.pack(len(text)) + text)
    for raw in body:
        message += raw
    message += bytes(pad_bytes)
    return message


def unpack(message: bytearray, device: torch.device) -> Tuple[Dict[str, Any], Dict[str, torch.Tensor]]:
    """The header and the tensors (on ``device``, in order) of a :func:`pack` message."""
    (length,) = _HEADER.unpack_from(message, 0)
    header = json.loads(bytes(message[_HEADER.size : _HEADER.size + length]))
    start = _HEADER.size + length
    tensors: Dict[str, torch.Tensor] = {}
    for name, dtype, shape, offset, nbytes in header["tensors"]:
        raw = torch.frombuffer(message, dtype=torch.uint8, count=nbytes, offset=start + offset) if nbytes else \
            torch.empty(0, dtype=torch.uint8)  # fmt: skip
        tensors[name] = raw.clone().view(getattr(torch, dtype)).reshape(shape).to(device)
    return header, tensors


def encode(layer: int, module: DecoderLayer, kv: Sequence[LayerKV] = (), pad_bytes: int = 0,
           header: Optional[Dict[str, Any]] = None) -> bytearray:  # fmt: skip
    """The message that moves ``module`` (layer ``layer``) and ``kv`` to another rank."""
    tensors: List[Tuple[str, torch.Tensor]] = list(module.state_dict().items())
    tensors += [("kv.%d.%s" % (item.sequence, part), t) for item in kv for part, t in (("k", item.keys),
                                                                                      ("v", item.values))]  # fmt: skip
    return pack(dict(header or {}, layer=layer), tensors, pad_bytes)


def decode(message: bytearray, config: LlamaConfig, device: torch.device) -> LayerMessage:
    """The layer (a module on ``device``) and the KV a message carries."""
    header, tensors = unpack(message, device)
    return layer_of(header, tensors, config, device)


def layer_of(header: Dict[str, Any], tensors: Dict[str, torch.Tensor], config: LlamaConfig,
             device: torch.device) -> LayerMessage:  # fmt: skip
    """The layer and KV of an unpacked :func:`encode` message."""
    weights = {n: t for n, t in tensors.items() if not n.startswith("kv.")}
    kv: Dict[int, Dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        if name.startswith("kv."):
            _, sequence, part = name.split(".")
            kv.setdefault(int(sequence), {})[part] = tensor
    module = DecoderLayer(config, header["layer"])
    module.load_state_dict(weights)
    module.to(device=device, dtype=next(iter(weights.values())).dtype)
    items = [LayerKV(s, parts["k"], parts["v"]) for s, parts in sorted(kv.items())]
    weight_bytes = sum(t.numel() * t.element_size() for t in weights.values())
    kv_bytes = sum(2 * i.keys.numel() * i.keys.element_size() for i in items)
    return LayerMessage(header["layer"], module, items, weight_bytes, kv_bytes, header["pad"])


def send_layer(comm: Any, dest: int, layer: int, module: DecoderLayer, kv: Sequence[LayerKV] = (),
               pad_bytes: int = 0) -> int:  # fmt: skip
    """Send a layer to rank ``dest`` (waiting until the buffer may be reused); the bytes sent."""
    message = encode(layer, module, kv, pad_bytes)
    mpi_link.send(comm, message, dest, TAG_MODULE)
    return len(message)


def receive_layer(comm: Any, config: LlamaConfig, device: torch.device, source: int = -1) -> Tuple[LayerMessage, int]:
    """Wait for a layer from ``source`` (any rank by default); the message and its size in bytes."""
    from mpi4py import MPI

    buffer, _, size = mpi_link.recv_bytes(comm, MPI.ANY_SOURCE if source < 0 else source, TAG_MODULE)
    return decode(buffer, config, device), size
