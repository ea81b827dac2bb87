"""`make venv`'s first step: refuse, in one line naming the fix, a set-up that cannot give
locks/cpu.txt, before anything is created or downloaded.

The lock admits one interpreter (its header's `# target:` line: CPython 3.11 on x86_64 Linux,
glibc >= 2.28, because torch's +cpu wheel is built for cp311 manylinux_2_28_x86_64 only) and one
torch build that PyPI does not serve (`torch==2.13.0+cpu`): it comes from a find-links folder
holding the wheel or from PyTorch's CPU index (TORCH_INDEX, e.g.
https://download.pytorch.org/whl/cpu). Runs on any Python 3.8+, so that a wrong one is named
rather than failing on syntax.

    python3 scripts/venv_check.py [--find-links DIR] [--torch-index URL]   # prints the problem
    python3 scripts/venv_check.py --torch-requirement                      # torch's lock entry

Prints nothing and exits 0 when the set-up can work; prints the problem and exits 2 otherwise.
"""

from __future__ import annotations

import argparse
import glob
import os
import platform
import re
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOCK = os.path.join(REPO, "locks", "cpu.txt")
TORCH_INDEX_EXAMPLE = "https://download.pytorch.org/whl/cpu"


def lock_target(text: str) -> tuple[str, str, str]:
    """(python `3.11`, machine `x86_64`, manylinux glibc `2.28`) from the lock's header."""
    m = re.search(r"^# target: Python (\d+\.\d+), (\w+)-manylinux_(\d+)_(\d+)", text, re.M)
    if m is None:
        raise SystemExit(f"{LOCK}: no `# target: Python X.Y, <arch>-manylinux_A_B` header line")
    return m.group(1), m.group(2), f"{m.group(3)}.{m.group(4)}"


def torch_entry(text: str) -> tuple[str, str]:
    """(version `2.13.0+cpu`, the requirement with its hashes) of the lock's torch."""
    m = re.search(r"^torch==(\S+) \\\n((?:    --hash=sha256:\w+(?: \\)?\n)+)", text, re.M)
    if m is None:
        raise SystemExit(f"{LOCK}: no torch==... entry")
    return m.group(1), m.group(0)


def interpreter_problem(want_python: str, want_machine: str, want_glibc: str) -> str | None:
    """Why this interpreter cannot install the lock, or None."""
    impl = platform.python_implementation()
    have = f"{sys.version_info[0]}.{sys.version_info[1]}"
    system, machine = platform.system(), platform.machine()
    libc, libc_version = platform.libc_ver()
    glibc_ok = libc == "glibc" and _version(libc_version) >= _version(want_glibc)
    wanted = ("CPython", want_python, "Linux", want_machine)
    if (impl, have, system, machine) == wanted and glibc_ok:
        return None
    libc_said = f"{libc} {libc_version}" if libc else "no glibc"
    return (
        f"locks/cpu.txt installs only on CPython {want_python}, {want_machine} Linux with "
        f"glibc >= {want_glibc}; {sys.executable} is {impl} {have} on {system} {machine} "
        f"({libc_said}): pass PYTHON=<a CPython {want_python} there> "
        f"(e.g. PYTHON=python{want_python})"
    )


def torch_problem(version: str, find_links: str, torch_index: str) -> str | None:
    """Why torch's CPU build cannot be found, or None."""
    if torch_index:
        return None
    fix = f"pass FIND_LINKS=<folder with the wheel> or TORCH_INDEX={TORCH_INDEX_EXAMPLE}"
    if not find_links:
        return f"torch {version} is not on PyPI: {fix}"
    if re.match(r"[a-z][a-z0-9+.-]*://", find_links):
        return None  # a URL: uv reads it
    names = [f"torch-{version}-*.whl", f"torch-{version.replace('+', '%2B')}-*.whl"]
    if any(glob.glob(os.path.join(find_links, n)) for n in names):
        return None
    return f"no torch-{version}-*.whl in FIND_LINKS={find_links}: {fix}"


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text)[:2]) or (0,)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--find-links", default="")
    parser.add_argument("--torch-index", default="")
    parser.add_argument("--torch-requirement", action="store_true")
    args = parser.parse_args(argv)
    with open(LOCK, encoding="utf-8") as f:
        text = f.read()
    version, requirement = torch_entry(text)
    if args.torch_requirement:
        sys.stdout.write(requirement)
        return 0
    problem = interpreter_problem(*lock_target(text)) or torch_problem(
        version, args.find_links, args.torch_index
    )
    if problem:
        print(problem)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
