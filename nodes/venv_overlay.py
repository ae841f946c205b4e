"""Let a new venv see the packages of the venv its Python came from: ``python -m nodes.venv_overlay VENV``,
run with that base venv's Python.

``--system-site-packages`` reaches only the base *installation*; when the base is itself a venv (an
emulated node runs the controller's environment), its site-packages are added with a ``.pth`` file,
and the files its packages installed outside site-packages that programs look for beside
``sys.prefix`` (shared libraries under ``lib/``, such as the mpich wheel's ``libmpi.so.12`` that
mpi4py loads, and compiled programs under ``bin/``, such as ``mpiexec``) are linked into the new venv.
Scripts are not linked: a console script would run the base's Python and install into the base.
"""

import os
import site
import sys
import sysconfig

PTH_NAME = "_hil_base_site.pth"


def _is_elf(path):
    try:
        with open(path, "rb") as handle:
            return handle.read(4) == b"\x7fELF"
    except OSError:
        return False


def prefix_files(prefix, site_dirs):
    """Files under ``prefix`` (outside ``site_dirs``) that the base's distributions installed."""
    from importlib.metadata import distributions

    found = set()
    for dist in distributions(path=site_dirs):
        for entry in dist.files or ():
            if not str(entry).startswith(".."):
                continue  # inside site-packages, which the .pth covers
            path = os.path.realpath(str(entry.locate()))
            relative = os.path.relpath(path, prefix)
            if relative.startswith(".."):
                continue
            top = relative.split(os.sep, 1)[0]
            library = top == "lib" and not any(path.startswith(os.path.realpath(d) + os.sep) for d in site_dirs)
            if library or (top == "bin" and _is_elf(path)):
                found.add(relative)
    return sorted(found)


def overlay(venv):
    """Write the ``.pth`` and the links; returns the number of links made."""
    base_prefix = os.path.realpath(sys.prefix)
    site_dirs = [d for d in site.getsitepackages() if os.path.isdir(d)]
    purelib = sysconfig.get_paths(vars={"base": venv, "platbase": venv})["purelib"]
    with open(os.path.join(purelib, PTH_NAME), "w") as handle:
        handle.write("\n".join(site_dirs) + "\n")
    made = 0
    for relative in prefix_files(base_prefix, site_dirs):
        target = os.path.join(venv, relative)
        if os.path.lexists(target):
            continue
        os.makedirs(os.path.dirname(target), exist_ok=True)
        os.symlink(os.path.join(base_prefix, relative), target)
        made += 1
    return made


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.prefix == getattr(sys, "base_prefix", sys.prefix):
        sys.stderr.write("usage: <base venv's python> -m nodes.venv_overlay VENV\n")
        sys.exit(2)
    print("linked %d files" % overlay(os.path.realpath(sys.argv[1])))
