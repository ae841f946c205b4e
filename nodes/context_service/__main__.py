"""``python -m nodes.context_service``: the LLM service daemon (see ``daemon.py``)."""

import sys

from .daemon import main

if __name__ == "__main__":
    sys.exit(main())
