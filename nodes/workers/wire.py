"""The bytes that cross MPI between device and server ranks: a frame of segments.

A frame is one MPI message (``MPI.BYTE``): a 16-byte frame header, one 64-byte header per segment,
then the segments' payloads in order. Everything is little-endian with explicit sizes, and tensors
travel as their raw bit patterns (bf16 as its 16-bit pattern), so ARM devices and an x86 server
read each other's frames without MPI datatype conversion.

Frame header ``<4sBBHQI``: magic ``HILW``, version, kind (DATA or STOP), segment count, iteration,
padding bytes. Padding (zeros after the payloads, ignored on arrival) makes hidden states weigh on the
wire what the emulated target model's would (8 KiB a token for Vicuna-7B in fp16, against the tiny
model's 1 KiB): :func:`padding_for`.

Segment header ``<QIBBBBIIIIdddd`` (64 bytes): request id, device rank, phase (prefill, decode,
release, verify, state), dtype, flags (last prompt chunk), reserved, start position, token count, width (hidden
size, or 1 for token ids), payload bytes, then four server-side times in seconds: queue wait and
compute (durations summed over stages), and the server's monotonic clock when the segment arrived
at stage 0 and when the last stage sent it back. Devices fill the times with zeros.

A VERIFY segment (HAT's speculative decoding) is a decode step of several positions whose every
deep state comes back, not only the last; its start may lie before what the server's caches hold,
which rolls them back to it. A STATE segment, appended by the last stage to its replies for the HAT
methods, carries the server's state (Sec. 3.2) as float32 ``[1, 2 + 2B]``: mu, the number of
pipeline stages, then B pairs (batched tokens, g seconds) of one stage's delay table.

Streaming serving (methods with ``streams``: the device is a client, the server generates on its own):
a REQUEST segment carries what the server must know of a request as float32 ``[1, 3]``
(max new tokens, TTFT_exp s, TDS_exp tokens/s; 0 for none), beside the PREFILL segment of its prompt's
token ids in the same frame. The server streams TOKENS segments, int32 ``[n, 1]`` token ids starting at
output index ``start``, flagged DONE on a request's last; a STATS segment just before that one
carries the request's float32 ``[1, 3]`` (preemptions, swaps, recomputes).
"""

import struct
import sys
from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch

MAGIC = b"HILW"
VERSION = 2
FRAME = struct.Struct("<4sBBHQI")
SEGMENT = struct.Struct("<QIBBBBIIIIdddd")

DATA, STOP = 1, 2
PREFILL, DECODE, RELEASE, VERIFY, STATE = 1, 2, 3, 4, 5
REQUEST, TOKENS, STATS = 6, 7, 8
LAST_CHUNK = 1
DONE = 2  # a TOKENS segment that ends its request

DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.int32: 3}
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}
# bf16 has no buffer-protocol type; it travels as int16 and is re-viewed on arrival.
_CARRIER = {torch.bfloat16: torch.int16}

if sys.byteorder != "little":  # every Jetson, phone and x86 server is little-endian
    raise ImportError("nodes.workers.wire assumes a little-endian host")


class WireError(ValueError):
    pass


class Segment(NamedTuple):
    request_id: int
    device: int
    phase: int
    start: int
    tokens: int
    payload: Optional[torch.Tensor] = None  # [tokens, width] hidden states or int32 token ids
    flags: int = 0
    queue_s: float = 0.0
    compute_s: float = 0.0
    server_arrival_s: float = 0.0
    server_depart_s: float = 0.0

    @property
    def last_chunk(self) -> bool:
        return bool(self.flags & LAST_CHUNK)


class Frame(NamedTuple):
    kind: int
    iteration: int
    segments: Tuple[Segment, ...]


def _payload_bytes(tensor: Optional[torch.Tensor]) -> Tuple[bytes, int, int]:
    if tensor is None:
        return b"", 0, 0
    if tensor.dtype not in DTYPE_CODES:
        raise WireError("dtype %s cannot cross the wire" % tensor.dtype)
    t = tensor.detach().to("cpu").contiguous()
    if t.dim() != 2:
        raise WireError("payloads are [tokens, width]; got shape %s" % (tuple(t.shape),))
    carrier = _CARRIER.get(t.dtype)
    raw = (t.view(carrier) if carrier is not None else t).numpy().tobytes()
    return raw, DTYPE_CODES[tensor.dtype], t.shape[1]


def padding_for(segments: Sequence[Segment], bytes_per_token: Optional[int]) -> int:
    """Bytes to add to a frame so that its hidden-state payloads weigh ``bytes_per_token`` a token
    (token ids and payloads already that large are not padded; None: no padding)."""
    if bytes_per_token is None:
        return 0
    pad = 0
    for s in segments:
        hidden = s.phase in (PREFILL, DECODE, VERIFY) and s.payload is not None and s.payload.dim() == 2
        if hidden and s.payload.shape[1] > 1:
            real = s.payload.shape[1] * s.payload.element_size()
            pad += s.tokens * max(0, bytes_per_token - real)
    return pad


def encode(kind: int, iteration: int, segments: Sequence[Segment], pad: int = 0) -> bytearray:
    """One frame as a bytearray ready for ``Send([buf, MPI.BYTE], ...)``, with ``pad`` zero bytes."""
    headers, payloads = [], []
    for s in segments:
        raw, dtype_code, width = _payload_bytes(s.payload)
        if s.payload is not None and s.payload.shape[0] != s.tokens:
            raise WireError(
                "segment of request %d says %d tokens, payload has %d" % (s.request_id, s.tokens, s.payload.shape[0])
            )
        try:
            packed = SEGMENT.pack(
                s.request_id,
                s.device,
                s.phase,
                dtype_code,
                s.flags,
                0,
                s.start,
                s.tokens,
                width,
                len(raw),
                s.queue_s,
                s.compute_s,
                s.server_arrival_s,
                s.server_depart_s,
            )
        except struct.error as error:
            raise WireError("segment of request %r does not fit its header: %s" % (s.request_id, error)) from None
        headers.append(packed)
        payloads.append(raw)
    out = bytearray(FRAME.pack(MAGIC, VERSION, kind, len(segments), iteration, pad))
    for part in headers + payloads:
        out += part
    if pad:
        out += bytes(pad)
    return out


def decode(buffer: bytearray) -> Frame:
    """Parse a frame; payload tensors share the buffer's memory (no copy)."""
    if len(buffer) < FRAME.size:
        raise WireError("frame of %d bytes is shorter than its header" % len(buffer))
    magic, version, kind, count, iteration, pad = FRAME.unpack_from(buffer, 0)
    if magic != MAGIC or version != VERSION:
        raise WireError("not a version-%d frame (magic %r, version %d)" % (VERSION, magic, version))
    offset = FRAME.size
    if len(buffer) < offset + count * SEGMENT.size:
        raise WireError("frame of %d bytes is too short for %d segment headers" % (len(buffer), count))
    headers = []
    for _ in range(count):
        headers.append(SEGMENT.unpack_from(buffer, offset))
        offset += SEGMENT.size
    segments: List[Segment] = []
    view = memoryview(buffer)
    for (
        request_id,
        device,
        phase,
        dtype_code,
        flags,
        _,
        start,
        tokens,
        width,
        nbytes,
        queue_s,
        compute_s,
        arrival_s,
        depart_s,
    ) in headers:
        payload = None
        if nbytes:
            if dtype_code not in CODE_DTYPES:
                raise WireError("request %d: unknown dtype code %d" % (request_id, dtype_code))
            dtype = CODE_DTYPES[dtype_code]
            itemsize = torch.empty((), dtype=dtype).element_size()
            if nbytes != tokens * width * itemsize or offset + nbytes > len(buffer):
                raise WireError(
                    "request %d: %d payload bytes for %d x %d %s (frame of %d bytes)"
                    % (request_id, nbytes, tokens, width, dtype, len(buffer))
                )
            carrier = _CARRIER.get(dtype, dtype)
            flat = torch.frombuffer(view[offset : offset + nbytes], dtype=carrier)
            payload = (flat.view(dtype) if carrier is not dtype else flat).view(tokens, width)
            offset += nbytes
        segments.append(
            Segment(request_id, device, phase, start, tokens, payload, flags, queue_s, compute_s, arrival_s, depart_s)
        )
    if offset + pad != len(buffer):
        raise WireError("frame has %d bytes after its payloads, its header says %d" % (len(buffer) - offset, pad))
    return Frame(kind, iteration, tuple(segments))
