"""U-shaped split inference (HAT Sec. 3.1): the device runs the embedding, the first m layers and the
head; the server runs the middle layers in P pipeline stages. The device sends the prompt's hidden
states at once, then one token's state per round trip."""

from .base import Method

METHODS = (
    Method(
        name="ushape",
        summary="U-shaped split: the device keeps the input and output submodels; one token per round trip",
    ),
)
