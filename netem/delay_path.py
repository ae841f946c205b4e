"""Delay paths: where a shaped direction's delay, jitter and loss are made, beside the HTB class that
gives it its rate. One interface, :class:`DelayPath`, and a registry of them by name.

A delay path says what a node must have for it (``readiness_probe``, a shell line the node's probe
runs, ``ready`` and ``not_ready``), the rules it holds on nodes outside tc, compiled from the tc
plans put on it (``compile``: :class:`HeldRules`, e.g. one per node, interface and side), the
commands that make a node hold exactly those given what it holds now (``commands``, from the node's
listing, which ``listing_argv`` reads, and the keys its link journal names), how a listing differs
from them (``differences``), the undo of what a journal names (``undo``), and which journal keys may
reach a command (``key_problem``). The leaf under each rate class is netem on the netem path and a
FIFO on every other (:meth:`netem.plan.TcPlan.leaf_kind`).

Two paths are built in: ``netem`` (:class:`NetemPath`: the leaf qdisc; nothing outside tc) and
``nfqueue`` (:class:`netem.nfqueue.NfqueuePath`: iptables rules on the receiver and a user-space delay
handler, for kernels without sch_netem). Another (a hardware link emulator, a kernel path per node)
is one module whose class implements :class:`DelayPath` and is given to :func:`register`;
``defaults.delay_path`` names it. ``auto`` takes the first built-in path whose node is ready, else
the last (its refusal says how to make it ready).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from netem.plan import TcPlan
    from netem.topology import LinkTopology

Key = tuple[str, ...]  # a held rule's identity in a node's link journal (NFQUEUE: interface, hook side)
InstalledTest = Callable[[str], str]  # a program of the suite -> an sh test that it is installed on the node


class HeldRules(Protocol):
    """What a delay path holds on one node outside tc (NFQUEUE: one iptables chain and its queues)."""

    @property
    def node(self) -> str: ...

    @property
    def delay_path(self) -> str: ...  # the name of the path that holds it

    @property
    def key(self) -> Key: ...  # its identity in the node's link journal

    @property
    def queues(self) -> tuple[dict, ...]: ...  # the queues a user-space delay handler serves (none: no handler)

    @property
    def description(self) -> str: ...  # what it delays, for a person ("orin -> server, xavier -> server")

    def rule_lines(self) -> list[str]: ...  # as the node lists them, for records and reports

    def apply_commands(self) -> list[list[str]]: ...  # on a node that holds none of it yet

    def undo_commands(self) -> list[list[str]]: ...  # of it as freshly applied


class DelayPath(Protocol):
    """One way to make delay, jitter and loss; see the module's docstring."""

    name: str
    auto: bool  # whether ``auto`` may choose it (the built-in paths)
    listing_argv: tuple[str, ...]  # reads the rules it holds back (run privileged); () when it holds none
    listing_name: str  # what that listing is, in a plan's lines ("iptables")

    def readiness_probe(self, installed: InstalledTest) -> str:
        """sh that prints one line: ``ready`` (or the path's word for it), or what the node lacks."""
        ...

    def ready(self, answer: str) -> bool: ...

    def not_ready(self, node: str, answer: str, what: str) -> str:
        """Why ``node`` cannot take ``what`` (an interface, directions) on this path, given its probe's
        ``answer``, and the fix."""
        ...

    def compile(
        self, topology: LinkTopology, plans: Sequence[TcPlan], traced: Collection[tuple[str, str]]
    ) -> tuple[HeldRules, ...]:
        """The rules the ``plans`` on this path need outside tc (``traced``: pairs a trace drives)."""
        ...

    def commands(self, held: Sequence[HeldRules], listing: str, journaled: Sequence[Key]) -> list[list[str]]:
        """The commands that make one node hold exactly ``held``, given its ``listing`` and the keys its
        journal names (an earlier apply's rules that are not held now go)."""
        ...

    def differences(self, held: HeldRules, listing: str) -> list[str]:
        """How a node's ``listing`` differs from ``held`` (empty: it matches)."""
        ...

    def undo(self, journaled: Sequence[Key], listing: str) -> list[list[str]]:
        """Remove those of the ``journaled`` rules still in ``listing``, and nothing else."""
        ...

    def key_problem(self, key: Key) -> str | None:
        """Why a journal's ``key`` must not reach a command (it is read back from a file on the node)."""
        ...

    def listed(self, key: Key, listing: str) -> list[str]:
        """The lines of ``listing`` that belong to the rules journaled as ``key`` (for ``link show``)."""
        ...


NETEM_PROBE = (  # prints loaded, builtin, module or missing: whether tc can create a netem qdisc here
    "if [ -d /sys/module/sch_netem ]; then echo loaded; "
    'elif grep -qs "/sch_netem.ko" "/lib/modules/$(uname -r)/modules.builtin"; then echo builtin; '
    "elif modprobe -n -q sch_netem 2>/dev/null; then echo module; "
    "else echo missing; fi"
)


class NetemPath:
    """The kernel's netem qdisc as the leaf of each delayed class: nothing held outside tc."""

    name = "netem"
    auto = True
    listing_argv: tuple[str, ...] = ()
    listing_name = ""

    def readiness_probe(self, installed: InstalledTest) -> str:
        return NETEM_PROBE

    def ready(self, answer: str) -> bool:
        return answer in ("loaded", "builtin", "module")

    def not_ready(self, node: str, answer: str, what: str) -> str:
        return (
            f"{node}: {what}: a profile has delay, jitter or loss and defaults.delay_path is netem, but the "
            "kernel has no sch_netem; set delay_path to auto (the NFQUEUE path) or drop delay/jitter/loss"
        )

    def compile(
        self, topology: LinkTopology, plans: Sequence[TcPlan], traced: Collection[tuple[str, str]]
    ) -> tuple[HeldRules, ...]:
        return ()

    def commands(self, held: Sequence[HeldRules], listing: str, journaled: Sequence[Key]) -> list[list[str]]:
        return []

    def differences(self, held: HeldRules, listing: str) -> list[str]:
        return []

    def undo(self, journaled: Sequence[Key], listing: str) -> list[list[str]]:
        return []

    def key_problem(self, key: Key) -> str | None:
        return "the netem path keeps nothing in the journal"

    def listed(self, key: Key, listing: str) -> list[str]:
        return []


_PATHS: dict[str, DelayPath] = {}


def _builtins() -> None:
    if not _PATHS:
        from netem.nfqueue import NfqueuePath

        _PATHS.update(netem=NetemPath(), nfqueue=NfqueuePath())


PROBE_SECTIONS = ("ssh", "addr", "journal", "handler")  # a node probe's other sections (and tc's "link X" ...)


def register(path: DelayPath) -> DelayPath:
    """Make ``path`` known by its name (the module that defines a delay path calls this on import). A
    node's probe reads each path's readiness in a section named by the path, and its listing in one
    named ``listing_name``: the names must all differ."""
    _builtins()
    taken = {"auto", *PROBE_SECTIONS, *_PATHS, *(p.listing_name for p in _PATHS.values() if p.listing_argv)}
    if path.name in taken or (path.listing_argv and path.listing_name in taken | {path.name}):
        raise ValueError(f"delay path {path.name!r} (listing {path.listing_name!r}): a name taken already "
                         f"(taken: {', '.join(sorted(taken))})")  # fmt: skip
    _PATHS[path.name] = path
    return path


def delay_path(name: str) -> DelayPath:
    _builtins()
    try:
        return _PATHS[name]
    except KeyError:
        raise ValueError(f"{name!r} is not a delay path (known: auto, {', '.join(_PATHS)})") from None


def names() -> tuple[str, ...]:
    """The known paths, built-in first, in registration order."""
    _builtins()
    return tuple(_PATHS)


def choose(preference: str, answers: dict[str, str] | None) -> str:
    """The path a node takes: the one ``preference`` names; for ``auto``, the first built-in path whose
    probe ``answers`` say ready, else the last built-in one. A node not probed (``answers`` None)
    takes the first built-in one for ``auto``."""
    if preference != "auto":
        return preference
    automatic = [path for path in (delay_path(n) for n in names()) if path.auto]
    if answers is None:
        return automatic[0].name
    for path in automatic:
        if path.ready(answers.get(path.name, "")):
            return path.name
    return automatic[-1].name


def by_path(held: Sequence[HeldRules]) -> dict[str, list[HeldRules]]:
    """``held`` grouped by the path that holds them (in the order the paths are known)."""
    out: dict[str, list[HeldRules]] = {}
    for name in names():
        mine = [r for r in held if r.delay_path == name]
        if mine:
            out[name] = mine
    return out

