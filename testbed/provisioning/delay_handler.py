"""The NFQUEUE delay handler as a node holds it: installed root-owned, run only from there.

``/usr/local/lib/hil-testbed/<digest>/`` (0755, root:root; ``<digest>``: the first 16 hex digits of the
sha256 of ``nodes/link_delay_handler.py``, so that checkouts of different versions share a node) holds
``link_delay_handler.py`` (0644) and ``link-delay-handler`` (0755), the one program of the delay path
that sudo runs: it runs the handler with a root-owned Python that can import ``netfilterqueue`` (the
installer refuses one whose executable, ``sys.path`` or binding lies in a directory that is not
root's, or that others may write). The handler keeps its files in root's ``/run/hil-testbed-delay``.

Installing puts code that runs as root on a node, so it is an administrator's step, never a sudo rule
of the SSH user's (a user who may install the handler may run anything as root): ``testbed provision``
runs the installer where the node lets it (root, or a sudo that allows it) and otherwise prints the
one command an administrator runs; ``testbed emulate up`` installs it on this machine.
"""

from __future__ import annotations

import hashlib
import shlex
from functools import cache
from pathlib import Path

from nodes.contracts.root_paths import ROOT_STATE

ROOT_LIB = "/usr/local/lib/hil-testbed"
RUN_ROOT = "/run/hil-testbed-delay"  # nodes/link_delay_handler.py RUN_ROOT
HANDLER_SOURCE = Path(__file__).resolve().parents[2] / "nodes" / "link_delay_handler.py"
LAUNCHER = "link-delay-handler"

# Run by the candidate Python as root: it imports netfilterqueue, and nothing it would load is in a
# directory that is not root's or that others may write (but for a sticky one such as /tmp, where they
# cannot replace what root put there).
_CHECK = r"""
import os, sys
try:
    import netfilterqueue
except ImportError as exc:
    sys.exit("%s cannot import netfilterqueue (%s): as root, pip install NetfilterQueue (needs "
             "libnetfilter-queue-dev)" % (sys.executable, exc))
bad = set()
for path in [sys.executable, os.path.realpath(sys.executable), netfilterqueue.__file__] + sys.path:
    p = first = os.path.abspath(path) if path else ""
    while p and os.path.exists(p):
        st = os.lstat(p)
        # others may write a root-owned sticky directory (/tmp) but not replace root's entries in it;
        # a sticky directory on sys.path itself would still let them add modules
        shared = st.st_mode & 0o022 and not os.path.islink(p) and not (st.st_mode & 0o1000 and p != first)
        if st.st_uid != 0 or shared:
            bad.add(p)
        if p == "/":
            break
        p = os.path.dirname(p)
if bad:
    sys.exit("not root's or writable by others, so root must not run %s: %s" % (sys.executable, ", ".join(sorted(bad))))
"""


@cache
def handler_digest() -> str:
    return hashlib.sha256(HANDLER_SOURCE.read_bytes()).hexdigest()[:16]


def install_dir() -> str:
    return f"{ROOT_LIB}/{handler_digest()}"


def launcher_path() -> str:
    """The installed program sudo runs (the sudoers rule allows ``ROOT_LIB/*/link-delay-handler``)."""
    return f"{install_dir()}/{LAUNCHER}"


def launcher_glob() -> str:
    return f"{ROOT_LIB}/*/{LAUNCHER}"


def run_dir(directory: str) -> str:
    """Root's directory of the handler named by ``directory`` (an absolute path on the node)."""
    return f"{RUN_ROOT}/{hashlib.sha256(directory.encode()).hexdigest()[:16]}"


def run_dir_script(directory_word: str) -> str:
    """sh that prints :func:`run_dir` on the node, for a ``directory`` the node's shell expands."""
    return f"printf '%s/%s' {RUN_ROOT} \"$(printf %s {directory_word} | sha256sum | cut -c1-16)\""


def launcher_python_script(launcher: str) -> str:
    """sh that prints the Python an installed launcher runs (empty for a launcher not ours)."""
    return f"sed -n 's/^exec \\([^ ]*\\) -I .*/\\1/p' {launcher} 2>/dev/null"


def installed_test() -> str:
    """A shell test that succeeds where this checkout's handler is installed and the Python its launcher
    runs is still there (a launcher another checkout installed outlives that checkout's venv)."""
    launcher = shlex.quote(launcher_path())
    return f'[ -x {launcher} ] && [ -x "$({launcher_python_script(launcher)})" ]'


def install_script(source: str, python: str, lib: str = ROOT_LIB) -> str:
    """sh, run as root, that installs the handler stored at ``source`` (verified by its digest) under
    ``lib`` to run with ``python`` (a path, or a name looked up on root's PATH); prints ``installed``.
    Idempotent; an installed copy whose launcher's Python is gone or can no longer import
    ``netfilterqueue`` (another checkout's venv, since removed) is installed again with ``python``."""
    digest = handler_digest()
    target = f"{lib}/{digest}"
    launcher = f'#!/bin/sh\\nexec %s -I {target}/link_delay_handler.py "$@"\\n'
    launcher_python = launcher_python_script(f'"$D/{LAUNCHER}"')
    installed = (
        f'[ -x "$D/{LAUNCHER}" ] && [ "$(sha256sum "$D/link_delay_handler.py" | cut -c1-16)" = {digest} ] '
        f'&& P=$({launcher_python}) && [ -x "$P" ] '
        "&& \"$P\" -I -c 'import netfilterqueue' 2>/dev/null"
    )
    return f"""set -eu
[ "$(id -u)" = 0 ] || {{ echo "run this as root" >&2; exit 3; }}
D={shlex.quote(target)}
if {installed}; then echo installed; exit 0; fi
S={shlex.quote(source)}
[ "$(sha256sum "$S" | cut -c1-16)" = {digest} ] || {{ echo "$S is not the delay handler {digest}" >&2; exit 3; }}
PY={shlex.quote(python)}
case "$PY" in /*) ;; *) PY=$(command -v "$PY") || {{ echo "no {python} on root's PATH" >&2; exit 3; }} ;; esac
case "$PY" in *[!A-Za-z0-9/._+-]*) echo "$PY: a Python path the launcher can name must be plain" >&2; exit 3 ;; esac
"$PY" -I -c {shlex.quote(_CHECK)}
install -d -o root -g root -m 0755 {shlex.quote(lib)} {ROOT_STATE}
exec 9>{shlex.quote(lib)}/.install.lock
flock 9  # one installer at a time (labs come up side by side)
if {installed}; then echo installed; exit 0; fi
T=$(mktemp -d {shlex.quote(lib)}/.install.XXXXXX)
install -o root -g root -m 0644 "$S" "$T/link_delay_handler.py"
printf '{launcher}' "$PY" > "$T/{LAUNCHER}"
chmod 0755 "$T/{LAUNCHER}" "$T"
chown -R root:root "$T"
rm -rf "$D"
mv "$T" "$D"
echo installed
"""
