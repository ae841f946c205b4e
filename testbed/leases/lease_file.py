"""The lease file on a node: who drives it now, for which campaign, until when.

One file a machine, ``/run/lock/hil-testbed.lease`` (tmpfs: a reboot, which also clears tc state and
power modes, clears it too; an emulated node names its own with ``HIL_TESTBED_LEASE_DIR``), readable and
writable by every user, so that controllers logging in as different users see one lease. Every change
is made under ``flock`` on the file, by a script that reads, decides and writes in one go; times are the
node's own clock, so that controllers whose clocks disagree still agree on when a lease expires.

A lease is its holder's while it is renewed: a holder that stops renewing (a controller killed with
SIGKILL, a laptop closed) loses it ``ttl`` after its last renewal, and anyone may take it then. The
holder is a key (the user, the controller's host and the campaign's directory), so that ``--resume``
of the same campaign takes its own lease back before it expired.

The file is lines of ``field=value``: key, holder, campaign, pid, taken_unix_s, renewed_unix_s,
expires_unix_s. What the script prints is ``lease-answer STATE NOW`` and then the lease's lines.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

LEASE_DIR_ENV = "HIL_TESTBED_LEASE_DIR"
DEFAULT_DIR = "/run/lock"
FILE_NAME = "hil-testbed.lease"
FIELDS = ("key", "holder", "campaign", "pid", "taken_unix_s", "renewed_unix_s", "expires_unix_s")
ANSWER = "lease-answer"
LOCK_WAIT_S = 2  # another controller's change takes milliseconds; longer means a stuck one
WORD_CHARACTERS = "_.@:/+=,~-"  # besides letters and digits: what a lease field may hold
SAFE_VALUE = re.compile(rf"^[A-Za-z0-9{re.escape(WORD_CHARACTERS)}]{{0,300}}$")
STATES = ("taken", "renewed", "held", "lost", "released", "free", "busy")


@dataclass(frozen=True)
class Lease:
    """A lease as the node has it; times on the node's clock."""

    key: str
    holder: str
    campaign: str
    pid: int
    taken_unix_s: float
    renewed_unix_s: float
    expires_unix_s: float

    def describe(self, node_now_s: float) -> str:
        left = self.expires_unix_s - node_now_s
        state = f"expires in {left:.0f} s" if left > 0 else f"expired {-left:.0f} s ago"
        return (f"{self.holder} (campaign {self.campaign}, pid {self.pid}), renewed "
                f"{node_now_s - self.renewed_unix_s:.0f} s ago, {state}")  # fmt: skip


@dataclass(frozen=True)
class LeaseAnswer:
    """What the node said: ``state`` (one of STATES), its clock, and the lease it has now (or had)."""

    state: str
    node_now_s: float
    lease: Lease | None

    @property
    def live(self) -> bool:
        return self.lease is not None and self.lease.expires_unix_s > self.node_now_s


def plain_word(text: str) -> str:
    """``text`` as a lease field may hold it: other characters as ``_``, at most 300."""
    return "".join(c if c.isascii() and (c.isalnum() or c in WORD_CHARACTERS) else "_" for c in text)[:300]


def _checked(value: str) -> str:
    if not SAFE_VALUE.match(value):
        raise ValueError(f"a lease field must be one plain word (letters, digits, ._@:/+=,~-): {value!r}")
    return value


def lease_request(key: str, fields: dict[str, str], ttl_s: float) -> bytes:
    """What :func:`lease_script` reads on stdin for ``take`` and ``renew`` (or ``release``: the key):
    who asks, and for how long. Each value is checked to be one plain word."""
    values = {"key": key, **fields, "ttl_s": str(max(1, round(ttl_s)))}
    return "".join(f"{name}={_checked(value)}\n" for name, value in values.items()).encode()


def lease_script(action: str) -> str:
    """sh for ``action`` on the node's lease, the asker on stdin (:func:`lease_request`); the same line
    for every asker, so that a run's plan lists it as it is sent:

    - ``take``: ours if the file is free, expired, or already ours (then ``renewed``); else ``held``.
    - ``renew``: extended if it is still ours; else ``lost`` (another took it after it expired, or it
      was released).
    - ``release``: emptied if it is ours; else ``held``. ``force``: emptied whoever holds it.
    - ``show``: nothing changed.
    Each prints the answer line and the lease the node has after the action (before, for ``held``)."""
    assert action in ("take", "renew", "release", "force", "show"), action
    write = (
        'taken=$(field taken_unix_s); [ "$mine" = 1 ] && [ -n "$taken" ] || taken=$now; '
        "printf 'key=%s\\nholder=%s\\ncampaign=%s\\npid=%s\\ntaken_unix_s=%s\\nrenewed_unix_s=%s\\n"
        "expires_unix_s=%s\\n' \"$key\" \"$holder\" \"$campaign\" \"$pid\" \"$taken\" \"$now\" "
        '"$((now + ttl))" | put || exit 3'
    )
    decide = {
        "take": f'if [ "$live" = 1 ] && [ "$mine" = 0 ]; then answer held; fi; {write}; '
                'if [ "$mine" = 1 ]; then answer renewed; else answer taken; fi',
        "renew": f'if [ "$mine" = 0 ]; then answer lost; fi; {write}; answer renewed',
        "release": 'if [ "$mine" = 0 ] && [ -s "$f" ]; then answer held; fi; put </dev/null; answer released',
        "force": 'put </dev/null; answer released',
        "show": 'if [ -s "$f" ]; then answer held; fi; answer free',
    }[action]
    read_request = (
        "key= holder= campaign= pid= ttl=1; "
        "while IFS='=' read -r k v; do case \"$k\" in key) key=$v;; holder) holder=$v;; campaign) campaign=$v;; "
        'pid) pid=$v;; ttl_s) ttl=$v;; esac; done; '
        if action in ("take", "renew", "release") else ""
    )
    return (
        read_request
        + f'd="${{{LEASE_DIR_ENV}:-{DEFAULT_DIR}}}"; f="$d/{FILE_NAME}"; umask 000; '
        f'[ -d "$d" ] || mkdir -p "$d" 2>/dev/null; '
        # Another user's file in a sticky directory must be opened without O_CREAT (fs.protected_regular,
        # on in most distributions, refuses it): created only when absent, locked read-only, written by dd.
        f'[ -e "$f" ] || {{ : >> "$f"; }} 2>/dev/null; '
        f'exec 9<"$f" 2>/dev/null || {{ echo "cannot open $f" >&2; exit 3; }}; '
        'put() { dd of="$f" conv=nocreat status=none 2>/dev/null || { echo "cannot write $f" >&2; exit 3; }; }; '
        f'flock -w {LOCK_WAIT_S} 9 || {{ echo "{ANSWER} busy $(date +%s)"; exit 0; }}; '
        'now=$(date +%s); '
        'field() { sed -n "s/^$1=//p" "$f" | head -n 1; }; '
        f'answer() {{ echo "{ANSWER} $1 $now"; cat "$f"; exit 0; }}; '
        'held_key=$(field key); expires=$(field expires_unix_s); '
        'mine=0; [ -n "$held_key" ] && [ "$held_key" = "${key:-}" ] && mine=1; '
        'live=0; [ -n "$expires" ] && [ "$expires" -gt "$now" ] 2>/dev/null && live=1; '
        f"{decide}"
    )


def parse_answer(stdout: str) -> LeaseAnswer:
    """The answer of :func:`lease_script`; ValueError if there is none."""
    lines = stdout.splitlines()
    head = next((i for i, line in enumerate(lines) if line.startswith(ANSWER + " ")), None)
    if head is None:
        raise ValueError(f"no lease answer in {stdout[-200:]!r}")
    words = lines[head].split()
    if len(words) != 3 or words[1] not in STATES:
        raise ValueError(f"not a lease answer: {lines[head]!r}")
    values = dict(line.split("=", 1) for line in lines[head + 1 :] if "=" in line)
    lease = None
    if values.get("key"):
        try:
            times = [float(values.get(name) or 0) for name in ("taken_unix_s", "renewed_unix_s", "expires_unix_s")]
            lease = Lease(values["key"], values.get("holder", "?"), values.get("campaign", "?"),
                          int(values.get("pid") or 0), *times)  # fmt: skip
        except ValueError:
            lease = None  # a file another program wrote: no lease of ours
    return LeaseAnswer(words[1], float(words[2]), lease)
