"""Endpoints that speak the OpenAI streaming API (``/v1/completions``, ``/v1/chat/completions``):
the device endpoint (the whole model on the phone, paced to its measured rates), the trace endpoint
(a server whose first-token and inter-token times replay a service's distributions) and the clients
DiSCo's dispatcher races them with. Tokens are always computed by the real checkpoint; their times
are the target's (modeled, and labelled so in every log)."""
