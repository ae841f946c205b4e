"""HAT (Sec. 3.3-3.5) and its ablations of Table 5: speculative decoding with the draft adapter (sd),
prompt chunking sized by the server's state (pc, Eq. 3) and parallel drafting (pd, Eq. 6). Every one
of them reads the server's state (mu, g) from its replies."""

from .base import Method

REPORT = ("acceptance length (vLLM's: 1 + accepted draft tokens / rounds) for the drafting methods",
          "chunk sizes and rounds per request in the device's logs")


def hat_method(name: str, features: str, summary: str) -> Method:
    parts = set(features.split("+"))
    return Method(
        name=name,
        summary=summary,
        prefill="device_chunks" if "pc" in parts else "whole",
        decode="speculative_parallel" if "pd" in parts else ("speculative" if "sd" in parts else "token"),
        server_state_in_replies=True,
        report_notes=REPORT,
    )


METHODS = (
    hat_method("sd", "sd", "U-shape + speculative decoding with the draft adapter (HAT Sec. 3.4)"),
    hat_method("pc", "pc", "U-shape + prompt chunks sized from the server's state (HAT Eq. 3)"),
    hat_method("sd_pc", "sd+pc", "speculative decoding and prompt chunking"),
    hat_method("sd_pd", "sd+pd", "speculative decoding with parallel drafting (HAT Eq. 6)"),
    hat_method("hat", "sd+pc+pd", "HAT: speculative decoding, prompt chunking and parallel drafting"),
)
