"""Running a command in a phone's shell with adb, from the phone's USB host."""

import subprocess


class AdbError(RuntimeError):
    """adb is missing, or the command failed on the phone."""


def adb_shell(adb: str, serial: str, command: str, timeout_s: float = 30.0) -> str:
    """The output of ``adb -s SERIAL shell COMMAND``; raises :class:`AdbError` on failure."""
    try:
        done = subprocess.run(
            [adb, "-s", serial, "shell", command],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            universal_newlines=True,
            timeout=timeout_s,
            check=False,
        )
    except FileNotFoundError:
        raise AdbError("adb is not installed on this host") from None
    except subprocess.TimeoutExpired:
        raise AdbError("adb -s %s shell did not answer within %g s" % (serial, timeout_s)) from None
    if done.returncode != 0:
        raise AdbError(
            "adb -s %s shell failed (%d): %s" % (serial, done.returncode, (done.stderr or done.stdout).strip()[-300:])
        )
    return done.stdout
