"""U-shape with Sarathi's chunked prefill on the server (HAT's U-Sarathi baseline, Sec. 4.1): the
server prefills a prompt in chunks of ``chunk_tokens`` and lets decode steps in between them."""

from .base import Method

METHODS = (
    Method(
        name="usarathi",
        summary="U-shape with server-side chunked prefill of chunk_tokens (Sarathi)",
        prefill="server_chunks",
        report_notes=("TTFT includes the chunked prefill; chunk_tokens is the Sarathi budget",),
    ),
)
