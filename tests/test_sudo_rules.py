"""The sudoers rules the suite prints cover exactly what it runs with sudo: every sudo'd command of the
example campaigns' run plans (with sudo on and delay on the NFQUEUE path), of a trace player's
schedule and of the Jetson power driver is allowed by the rules provisioning prints, and each is one
fixed command with an absolute path (never ``sh -c`` under sudo). The rules are read back by a
sudoers matcher written here (sudo's own matching: the command path as a glob that does not cross
``/``, the arguments as one string), and checked by ``visudo``."""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from testbed.campaign.load import load_campaign
from testbed.campaign.plan import plan_run
from testbed.emulation.resolved import as_real_lab
from testbed.inventory import load_inventory
from testbed.provisioning.provision import judge_readiness
from testbed.transport.facts import NodeFacts

REPO = Path(__file__).resolve().parent.parent
CAMPAIGNS = sorted((REPO / "examples" / "campaigns").glob("*.yaml"))
SECURE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"  # Debian's and Ubuntu's


# -- sudoers, read back -------------------------------------------------------------------------------


def _split_commas(text: str) -> list[str]:
    """Split at the commas sudoers separates commands with (``\\,`` is a comma inside one)."""
    return [part.strip() for part in re.split(r"(?<!\\),", text) if part.strip()]


def _unescape(text: str) -> str:
    return re.sub(r"\\([,:=\\])", r"\1", text)


def parse_rules(text: str, user: str) -> list[tuple[str, str | None]]:
    """The commands ``user`` may run as root without a password: (path glob, argument pattern; None
    for any arguments, "" for none), from sudoers text (Cmnd_Alias lines and the user's line)."""
    aliases: dict[str, list[str]] = {}
    allowed: list[str] = []
    for raw in text.splitlines():
        line = raw.strip().removeprefix("echo '").split("' |")[0].strip()
        if line.startswith("Cmnd_Alias "):
            name, _, commands = line.removeprefix("Cmnd_Alias ").partition("=")
            aliases[name.strip()] = _split_commas(commands)
        elif line.startswith(f"{user} ALL=(root) NOPASSWD:"):
            allowed += _split_commas(line.split("NOPASSWD:", 1)[1])
    rules = []
    for item in allowed:
        for command in aliases.get(item, [item]):
            path, _, args = command.partition(" ")
            rules.append((path, None if not args else "" if args.strip() == '""' else _unescape(args.strip())))
    return rules


def _path_matches(pattern: str, path: str) -> bool:
    """A command path glob: ``*`` and ``?`` never match ``/`` (sudo globs the path)."""
    parts, wanted = path.split("/"), pattern.split("/")
    return len(parts) == len(wanted) and all(fnmatch.fnmatchcase(p, w) for p, w in zip(parts, wanted, strict=True))


def allowed(rules: Sequence[tuple[str, str | None]], argv: Sequence[str]) -> bool:
    """Whether sudo would run ``argv`` under ``rules`` (arguments matched as one string, as sudo does)."""
    args = " ".join(argv[1:])
    for path, pattern in rules:
        if not _path_matches(path, argv[0]):
            continue
        if pattern is None or (pattern == "" and not args) or (pattern and fnmatch.fnmatchcase(args, pattern)):
            return True
    return False


# -- what a line runs with sudo -----------------------------------------------------------------------

OPERATORS = {"||", "&&", ";", "|", "&", "(", ")", ">", ">>", "<", ">&", ";;", "{", "}"}
COMMAND_AFTER = OPERATORS | {"if", "then", "elif", "else", "do", "while", "until", "exec", "!", "$("}


def _words(script: str) -> list[str]:
    lexer = shlex.shlex(script, posix=True, punctuation_chars=";&|()<>")
    lexer.whitespace_split = True
    lexer.commenters = ""
    return list(lexer)


def sudo_argvs(line: str) -> Iterator[list[str]]:
    """Every command ``line`` (a shell line as the transport sends it) runs under sudo, also inside
    ``sh -c`` scripts (``sudo -l``, which only lists, excluded)."""
    words = _words(line)
    for i, word in enumerate(words):
        if word == "sh" and i + 2 < len(words) and words[i + 1] == "-c":
            yield from sudo_argvs(words[i + 2])
        if word != "sudo" or (i > 0 and words[i - 1] not in COMMAND_AFTER):
            continue  # not in a command's place (e.g. a word of an echo)
        j = i + 1
        options = []
        while j < len(words) and words[j].startswith("-"):
            options.append(words[j])
            j += 1
            if options[-1] == "--":
                break
        if "-l" in options:
            continue
        argv = []
        while j < len(words) and words[j] not in OPERATORS:
            redirected = j + 1 < len(words) and words[j + 1] in (">", ">>", "<", ">&") and words[j].isdigit()
            if redirected:  # 2>/dev/null: the 2 is the redirection's
                break
            argv.append(words[j])
            j += 1
        yield argv


def resolved(argv: list[str]) -> list[str]:
    """A bare command name as sudo resolves it (its secure_path, on this machine)."""
    if argv and "/" not in argv[0]:
        found = shutil.which(argv[0], path=SECURE_PATH)
        return [found or argv[0], *argv[1:]]
    return argv


# -- the rules provisioning prints -----------------------------------------------------------------------

USER = "lab"
NODE_TEXT = """
defaults: {ssh: {user: lab}, sudo: true}
nodes:
  - {name: orin, kind: jetson, model: agx-orin, address: 192.0.2.1}
"""


def printed_rules(tmp_path: Path, tool_paths: dict[str, str] | None = None) -> tuple[str, list]:
    """The sudoers text provisioning prints for a node whose sudo allows none of the suite's commands."""
    path = tmp_path / "node.yaml"
    path.write_text(NODE_TEXT)
    node = load_inventory(path).node("orin")
    facts = NodeFacts(node="orin", kind="jetson", user=USER, sudo="yes")
    values = {"tool": ["tc", "ip", "iperf3", "apt-get"], "workdir_free_kb": [str(50 << 20)],
              "sudo_needed": ["HIL_TC", "HIL_IP", "HIL_DELAY", "HIL_JETSON", "HIL_PROBE"]}  # what the probe says
    if tool_paths:
        values["tool_path"] = [f"{k}:{v}" for k, v in tool_paths.items()]
    missing, _ = judge_readiness(node, facts, values, need_gib=0.1, sudo_used=True)
    text = "\n".join(fix for what, fix in missing if "sudo" in what)
    assert text, missing
    return text, parse_rules(text, USER)


def lab_copy(inventory: Path, directory: Path) -> Path:
    """``inventory`` as a real lab reached as a non-root user with sudo, delay on the NFQUEUE path."""
    return as_real_lab(inventory, directory / f"{inventory.stem}-sudo.yaml", delay_path="nfqueue", user=USER)


def campaign_sudo_argvs(campaign_path: Path, directory: Path) -> dict[tuple[str, ...], str]:
    """Every sudo'd command line of every run's plan (offline, as `--dry-run` plans an unreachable
    lab), and of its trace players' schedules: argv -> what the plan says it is for."""
    inventory = re.search(r"^inventory: (\S+)", campaign_path.read_text(), re.M)
    assert inventory is not None
    campaign = load_campaign(campaign_path, inventory=lab_copy((campaign_path.parent / inventory[1]).resolve(),
                                                               directory))  # fmt: skip
    found: dict[tuple[str, ...], str] = {}
    shapes: dict[str, object] = {}  # a run per shape of what is sudo'd: its links, power modes, method
    for run in campaign.runs:
        s = run.settings
        shapes.setdefault(json.dumps([s.link.model_dump(mode="json"), s.power, s.method], sort_keys=True), run)
    for run in shapes.values():
        plan = plan_run(campaign, run, 1, live=False)
        for command in plan.commands:
            for argv in sudo_argvs(command.line):
                found.setdefault(tuple(argv), f"{campaign_path.name}: {command.what}")
        for schedule in plan.shaping.players:  # the trace players' tc commands, as they run them
            for step in schedule.steps:
                for argv in step["commands"]:
                    found.setdefault(tuple(argv[3:]), f"{campaign_path.name}: the trace player")
    return found


@pytest.mark.slow
def test_every_command_the_example_campaigns_run_with_sudo_is_one_fixed_command_the_printed_rules_allow(
    tmp_path: Path,
) -> None:
    text, rules = printed_rules(tmp_path)
    found: dict[tuple[str, ...], str] = {}
    for path in CAMPAIGNS:
        found.update(campaign_sudo_argvs(path, tmp_path))
    refused = [f"{why}: {shlex.join(argv)}" for argv, why in found.items() if not allowed(rules, resolved(list(argv)))]
    assert not refused, "sudo'd but not allowed by the printed rules:\n" + "\n".join(refused[:20]) + "\n" + text
    relative = sorted({argv[0] for argv in found if not argv[0].startswith("/") and argv[0] != "true"})
    assert not relative, f"sudo'd commands without an absolute path: {relative}"
    programs = {argv[0] for argv in found}
    assert "sh" not in {Path(p).name for p in programs}
    # the campaigns shape links (tc) with delay on the NFQUEUE path (the delay handler, and iptables through it)
    for wanted in ("/tc", "/link-delay-handler"):
        assert any(p.endswith(wanted) for p in programs), (wanted, programs)


def test_the_rules_allow_nothing_beyond_the_suites_commands(tmp_path: Path) -> None:
    """A shell, a table other than mangle, tc's batch files, ip's namespaces, nvpmodel's config files,
    jetson_clocks restoring a user's file: all refused."""
    _text, rules = printed_rules(tmp_path)
    handler = next(path for path, _ in rules if path.endswith("/link-delay-handler"))
    for argv in (
        ["/usr/bin/sh", "-c", "id"],
        ["/usr/sbin/iptables", "-w", "-t", "mangle", "-S"],  # iptables only through the delay handler's checks
        ["/usr/sbin/tc", "-batch", "/etc/shadow"],
        ["/usr/sbin/ip", "netns", "exec", "x", "sh"],
        ["/usr/sbin/ip", "-batch", "/etc/shadow"],
        ["/usr/sbin/nvpmodel", "-f", "/home/lab/evil.conf", "-m", "0"],
        ["/usr/bin/jetson_clocks", "--restore", "/home/lab/l4t_dfs.conf"],
        ["/usr/bin/jetson_clocks", "--store", "/etc/shadow"],
        ["/usr/local/lib/hil-testbed/link-delay-handler", "start"],  # only from a version's own directory
        ["/usr/local/lib/hil-testbed/x/../../../../tmp/link-delay-handler"],
        [handler.replace("*", "0123456789abcdef").replace("link-delay-handler", "link_delay_handler.py")],
    ):
        assert not allowed(rules, argv), argv


@pytest.mark.skipif(shutil.which("visudo") is None, reason="visudo is not installed (make system-packages)")
def test_the_printed_rules_are_valid_sudoers(tmp_path: Path) -> None:
    text, rules = printed_rules(tmp_path)
    sudoers = tmp_path / "hil-testbed"
    lines = [line for line in text.splitlines() if re.match(rf"(#|Cmnd_Alias |{USER} ALL=)", line)]
    sudoers.write_text("\n".join(lines) + "\n")
    checked = subprocess.run(["visudo", "-cf", str(sudoers)], capture_output=True, text=True, check=False)
    assert checked.returncode == 0, checked.stdout + checked.stderr + text
    assert len(rules) >= 10


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("sudo") is None, reason="runs the stand-ins as root with sudo")
def test_the_jetson_power_driver_runs_only_commands_the_rules_allow(tmp_path: Path) -> None:
    """The node-side power driver (`python -m nodes.power --sudo`: set a mode with locked clocks, then
    restore) against the emulated Jetson's stand-in tools, with a ``sudo`` on PATH that records what
    it is asked to run before the real sudo runs it."""
    from testbed.emulation.node_files import NodeFiles, write_node_tools
    from testbed.emulation.plan import EmulatedNodePlan
    from testbed.emulation.sshd_server import SshKeys
    from testbed.inventory import EmulatedPowerMode

    state = tmp_path / "state"
    keys = SshKeys.create(state / "keys")
    write_node_tools(state, keys)
    modes = (EmulatedPowerMode(id=0, name="MAXN", cpus=0.5, idle_w=5, busy_w=30),
             EmulatedPowerMode(id=2, name="MODE_30W", cpus=0.25, idle_w=5, busy_w=20))  # fmt: skip
    node = EmulatedNodePlan("orin", "jetson", "agx-orin", 0, "x", "x", "x", "x", "10.0.0.2", "10.0.1.2", modes, 0)
    files = NodeFiles(state, node)
    files.create(mode="local", cgroup=None)
    recorder = tmp_path / "recorder"
    recorder.mkdir()
    log = tmp_path / "sudo.log"
    (recorder / "sudo").write_text(f'#!/bin/sh\nprintf "%s\\n" "$*" >> {log}\nexec /usr/bin/sudo "$@"\n')
    (recorder / "sudo").chmod(0o755)
    env = {**os.environ, **files.environment("local"), "PYTHONPATH": str(REPO)}
    env["PATH"] = f"{recorder}:{env['PATH']}"
    journal = tmp_path / "power" / "journal.json"
    clocks = Path("/var/lib/hil-testbed/l4t_dfs.conf")
    made_dir = not clocks.parent.exists()
    try:
        for action in (["set", "MODE_30W", "--lock-clocks"], ["restore"]):
            done = subprocess.run([sys.executable, "-m", "nodes.power", "--kind", "jetson", "--journal", str(journal),
                                   "--sudo", *action], env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
            assert done.returncode == 0, done.stdout + done.stderr
            assert "error" not in json.loads(done.stdout)
    finally:
        clocks.unlink(missing_ok=True)
        if made_dir:
            shutil.rmtree(clocks.parent, ignore_errors=True)
    standins = {tool: str(files.jetson_bin / tool) for tool in ("nvpmodel", "jetson_clocks")}
    text, rules = printed_rules(tmp_path, standins)
    ran = [shlex.split(line) for line in log.read_text().splitlines()]
    assert ran and all(argv[:2] == ["-n", "--"] for argv in ran), ran
    programs = {Path(argv[2]).name for argv in ran}
    assert programs == {"nvpmodel", "jetson_clocks"}, programs
    refused = [argv[2:] for argv in ran if not allowed(rules, argv[2:])]
    assert not refused, f"{refused}\n{text}"


def test_the_matcher_reads_sudoers_as_sudo_does() -> None:
    rules = parse_rules('Cmnd_Alias A = /usr/sbin/tc qdisc *, /usr/bin/true ""\nu ALL=(root) NOPASSWD: A, /opt/*/x\n',
                        "u")  # fmt: skip
    assert allowed(rules, ["/usr/sbin/tc", "qdisc", "replace", "dev", "eth0", "root"])
    assert not allowed(rules, ["/usr/sbin/tc", "-b", "f"]) and not allowed(rules, ["tc", "qdisc", "show"])
    assert allowed(rules, ["/usr/bin/true"]) and not allowed(rules, ["/usr/bin/true", "x"])
    assert allowed(rules, ["/opt/a/x", "any", "thing"]) and not allowed(rules, ["/opt/a/b/x"])
    line = "exec sh -c 'sudo -n -- /usr/sbin/tc qdisc del dev x root || { echo no >&2; exit 3; }\nsudo -n -l /x'"
    assert list(sudo_argvs(line)) == [["/usr/sbin/tc", "qdisc", "del", "dev", "x", "root"]]
    assert list(sudo_argvs("exec sudo -n -- /a b")) == [["/a", "b"]]


@pytest.mark.skipif(os.geteuid() != 0, reason="installs root-owned files")
def test_the_installer_puts_the_handler_root_owned_and_refuses_a_python_others_may_change(tmp_path: Path) -> None:
    """The delay handler runs as root: the installer copies it (verified by its digest) into root's
    directory, 0755/0644, and refuses a Python whose code others may change (a venv in a directory
    anyone may write, that sees this machine's packages through a .pth file)."""
    from testbed.provisioning.delay_handler import HANDLER_SOURCE, LAUNCHER, handler_digest, install_script

    lib = tmp_path / "lib"
    venv = tmp_path / "open-venv"
    site = venv / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
    site.mkdir(parents=True)
    (venv / "bin").mkdir()
    (venv / "bin" / "python3").symlink_to(os.path.realpath(sys.executable))
    (venv / "pyvenv.cfg").write_text(f"home = {Path(os.path.realpath(sys.executable)).parent}\n")
    (site / "machine.pth").write_text(next(p for p in sys.path if p.endswith("site-packages")) + "\n")
    venv.chmod(0o777)

    def install(python: str) -> subprocess.CompletedProcess[str]:
        script = install_script(str(HANDLER_SOURCE), python, lib=str(lib))
        return subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=120, check=False)

    refused = install(str(venv / "bin" / "python3"))
    assert refused.returncode != 0 and "not root's or writable by others" in refused.stderr, refused.stderr
    assert str(venv) in refused.stderr and not (lib / handler_digest()).exists()
    done = install(sys.executable)
    assert (done.returncode, done.stdout.strip()) == (0, "installed"), done.stderr
    target = lib / handler_digest()
    for path, mode in ((target, 0o755), (target / "link_delay_handler.py", 0o644), (target / LAUNCHER, 0o755)):
        st = path.stat()
        assert (st.st_uid, st.st_gid, st.st_mode & 0o7777) == (0, 0, mode), path
    assert (target / "link_delay_handler.py").read_bytes() == HANDLER_SOURCE.read_bytes()
    checked = subprocess.run([str(target / LAUNCHER), "iptables", "-w", "-t", "filter", "-S"], capture_output=True,
                             text=True, timeout=60, check=False)  # fmt: skip
    assert checked.returncode == 2 and "refused" in checked.stderr  # the installed handler answers, isolated
    assert install(sys.executable).stdout.strip() == "installed"  # again: nothing to do
    launcher = (target / LAUNCHER).read_text()
    # a copy another checkout installed outlives that checkout's venv: found broken, installed again
    venv.chmod(0o755)
    (target / LAUNCHER).write_text(launcher.replace(sys.executable, str(venv / "bin" / "python3")))
    assert install(sys.executable).stdout.strip() == "installed"
    assert (target / LAUNCHER).read_text() == launcher.replace(sys.executable, str(venv / "bin" / "python3"))
    shutil.rmtree(venv)
    again = install(sys.executable)
    assert (again.returncode, again.stdout.strip()) == (0, "installed"), again.stderr
    assert (target / LAUNCHER).read_text() == launcher
    answers = subprocess.run([str(target / LAUNCHER), "iptables", "-w", "-t", "filter", "-S"], capture_output=True,
                             text=True, timeout=60, check=False)  # fmt: skip
    assert answers.returncode == 2 and "refused" in answers.stderr
    odd_script = install_script(str(HANDLER_SOURCE), str(tmp_path / "a dir" / "python3"), lib=str(tmp_path / "lib3"))
    odd = subprocess.run(["sh", "-c", odd_script], capture_output=True, text=True, timeout=120, check=False)
    # a path the launcher's line could not carry
    assert odd.returncode == 3 and "must be plain" in odd.stderr, odd.stderr
    # labs come up side by side: installers at once leave one complete copy
    lib = tmp_path / "lib2"
    script = install_script(str(HANDLER_SOURCE), sys.executable, lib=str(lib))
    racing = [subprocess.Popen(["sh", "-c", script], stdout=subprocess.PIPE, text=True) for _ in range(3)]
    assert [p.communicate(timeout=120)[0].strip() for p in racing] == ["installed"] * 3
    assert sorted(p.name for p in lib.iterdir()) == sorted([".install.lock", handler_digest()])
    assert sorted(p.name for p in (lib / handler_digest()).iterdir()) == sorted([LAUNCHER, "link_delay_handler.py"])
