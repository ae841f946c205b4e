"""Values read back from a journal are checked again before they reach a shell or a tool's command
line. A journal is a file that anyone with the node's account can edit and that a crash or a
hand-mended copy can leave odd; what it says goes into ``su -c``, ``tc``, ``kill`` and the like. So each
value must match, in full, a strict pattern of what its writer puts there, or it is refused with the
journal and the field named (standard library, Python 3.8: both sides use it)."""

import re
from typing import Any, Pattern

# a path the testbed writes under a node's workdir: no shell metacharacters, spaces or ".." components
_PATH_WORD = r"[A-Za-z0-9_.@+-]+"
NODE_PATH = re.compile(r"(?:~|/%s)(?:/%s)*" % (_PATH_WORD, _PATH_WORD) + r"|/")
INTERFACE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@:-]{0,14}")  # IFNAMSIZ: 15 characters


class JournalValueError(ValueError):
    """A value read back from a journal is not what its writer writes there."""


def checked(value: Any, pattern: Pattern[str], field: str, what: str) -> str:
    """``value`` when it is a string that ``pattern`` matches in full; otherwise a
    :class:`JournalValueError` that names ``field`` and says it should be ``what``."""
    if not isinstance(value, str) or pattern.fullmatch(value) is None:
        raise JournalValueError("%s: %s is not %s" % (field, _shown(value), what))
    return value


def checked_path(value: Any, field: str, under: str = "", suffix: str = "") -> str:
    """A node path from a journal: absolute or ``~/``, plain characters, no ``..`` component, and
    (when given) inside the directory ``under`` and ending in ``suffix``."""
    path = checked(value, NODE_PATH, field, "a plain absolute or ~/ path (letters, digits, _ . @ + - and /)")
    if ".." in path.split("/"):
        raise JournalValueError("%s: %s has a '..' component" % (field, _shown(value)))
    if under and not (path + "/").startswith(under.rstrip("/") + "/"):
        raise JournalValueError("%s: %s is not under %s" % (field, _shown(value), under))
    if suffix and not path.endswith(suffix):
        raise JournalValueError("%s: %s does not end in %s" % (field, _shown(value), suffix))
    return path


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."
