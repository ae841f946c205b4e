"""The model parts and draft adapters a rank has loaded, kept from one run to the next in a warm pool
(:mod:`nodes.workers.pool`) when the next run asks for the same ones."""

from typing import Any, Callable, Dict, Hashable, List


class PartCache:
    """Model parts and draft adapters a rank has loaded, kept for the next run that asks for the same.

    A run asks through :meth:`get` while its worker is built. A part it must load is loaded only
    after what it has not asked for so far is dropped, and :meth:`settle` drops the rest of what it
    did not ask for, so a pool never holds more than one run's parts (a 7B model's part fills a board)."""

    def __init__(self) -> None:
        self._held = {}  # type: Dict[Hashable, Any]
        self._asked = set()  # type: set
        self.loaded = []  # type: List[str]
        self.reused = []  # type: List[str]

    def get(self, key: Hashable, load: Callable[[], Any], what: str) -> Any:
        if key in self._held:
            self.reused.append(what)
        else:
            for other in [k for k in self._held if k not in self._asked]:
                del self._held[other]  # before loading: the old part and the new one never both in memory
            self._held[key] = load()
            self.loaded.append(what)
        self._asked.add(key)
        return self._held[key]

    def settle(self) -> None:
        """Forget what the run just built did not ask for; start counting for the next run."""
        for key in [k for k in self._held if k not in self._asked]:
            del self._held[key]
        self._asked = set()

    def take_report(self) -> Dict[str, List[str]]:
        report = {"loaded": self.loaded, "reused": self.reused}
        self.loaded, self.reused = [], []
        return report
