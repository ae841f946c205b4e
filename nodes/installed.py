"""What this Python environment holds, as one JSON object on stdout: ``python -m nodes.installed``.

Run by provisioning with the node's venv Python, so that the controller can record (and campaigns
compare) package versions, torch and its CUDA, and the MPI library with its ABI. Standard library
only; every probe that fails says why in the output instead of failing the whole report.
"""

import json
import os
import platform
import sys

from nodes.contracts.tool_errors import error_answer

PACKAGES = (
    "hil-testbed-nodes",
    "numpy",
    "torch",
    "mpi4py",
    "mpich",
    "safetensors",
    "tokenizers",
    "jinja2",
    "jetson-stats",
    "nvidia-ml-py",
)


def package_versions():
    try:
        from importlib.metadata import PackageNotFoundError, version
    except ImportError:  # pragma: no cover - Python 3.7
        return {}
    out = {}
    for name in PACKAGES:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def torch_facts():
    try:
        import torch
    except Exception as exc:
        return json.loads(error_answer(exc))
    facts = {"version": torch.__version__, "cuda": torch.version.cuda, "file": torch.__file__}
    try:
        facts["cuda_devices"] = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception as exc:
        facts["cuda_error"] = str(exc)
    return facts


def mpi_library_file():
    """The MPI shared library this process mapped (from /proc/self/maps), or None."""
    try:
        with open("/proc/self/maps") as handle:
            for line in handle:
                path = line.split()[-1] if len(line.split()) >= 6 else ""
                if os.path.basename(path).startswith(("libmpi.so", "libmpi_")):
                    return path
    except OSError:
        pass
    return None


def mpi_abi(vendor, library_file):
    """A name that must be equal on every rank of one run: the MPI family and its library's soname.

    MPICH-derived libraries (MPICH, Intel MPI, MVAPICH, Cray) share the ``libmpi.so.12`` ABI; Open MPI
    has its own, which differs between major versions.
    """
    family = "mpich" if vendor in ("MPICH", "Intel MPI", "MVAPICH", "MVAPICH2", "Cray MPICH") else vendor.lower()
    soname = os.path.basename(library_file) if library_file else "unknown"
    parts = soname.split(".so.")
    soname = parts[0] + ".so." + parts[1].split(".")[0] if len(parts) == 2 else soname
    return "%s/%s" % (family.replace(" ", "-"), soname)


def mpi_facts():
    try:
        import mpi4py

        mpi4py.rc.initialize = False  # asking for versions needs no MPI_Init
        mpi4py.rc.finalize = False
        from mpi4py import MPI
    except Exception as exc:
        return json.loads(error_answer(exc))
    vendor, vendor_version = MPI.get_vendor()
    library_file = mpi_library_file()
    return {
        "mpi4py": mpi4py.__version__,
        "vendor": vendor,
        "vendor_version": ".".join(str(v) for v in vendor_version),
        "standard": "%d.%d" % MPI.Get_version(),
        "library_version": MPI.Get_library_version().strip().splitlines()[0],
        "library_file": library_file,
        "abi": mpi_abi(vendor, library_file),
    }


def report():
    return {
        "python": {
            "version": platform.python_version(),
            "executable": sys.executable,
            "prefix": sys.prefix,
            "base_prefix": getattr(sys, "base_prefix", sys.prefix),
        },
        "machine": platform.machine(),
        "packages": package_versions(),
        "torch": torch_facts(),
        "mpi": mpi_facts(),
    }


if __name__ == "__main__":
    json.dump(report(), sys.stdout, sort_keys=True)
    sys.stdout.write("\n")
