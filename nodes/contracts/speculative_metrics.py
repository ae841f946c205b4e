"""The acceptance length of speculative decoding, defined once for both sides (standard library,
Python 3.8): the device worker writes it into its request records, the controller's analysis
(``analysis.metrics``) reports it over many requests.

vLLM's "mean acceptance length": tokens emitted per verification round, the bonus (or corrected)
token counted, i.e. 1 + accepted draft tokens / rounds.
"""

from typing import Optional


def acceptance_length(accepted_tokens: float, rounds: float) -> Optional[float]:
    """1 + ``accepted_tokens`` / ``rounds``; None when there was no round."""
    if not rounds:
        return None
    return 1.0 + float(accepted_tokens) / float(rounds)
