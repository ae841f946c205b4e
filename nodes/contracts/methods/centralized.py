"""Centralized inference, the baseline without a split: the device sends the prompt's token ids and
the server runs the whole model (embedding, every layer, head) and returns each token."""

from .base import Method

METHODS = (
    Method(
        name="centralized",
        summary="the device sends token ids; the server runs the whole model",
        token_ids_only=True,
        report_notes=("no hidden states cross the link: only token ids go up and tokens come down",),
    ),
)
