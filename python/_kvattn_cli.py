"""The `kvattn` command installed by pip (the wheel's console-script entry
point): replaces this process with the C program `kvattn` (kvattn info,
kvattn bench, ...), passing the same arguments.

A top-level module beside the kvattn package, not inside it: importing
kvattn loads numpy and the library (a second or more), which the command
does not need. The program is looked for next to $KVATTN_LIB (the CLI is
built beside the library), in the package's kvattn/_lib/ (a wheel's copy, or
an editable install's), then in the tree's build/ (`make`; this file is
python/_kvattn_cli.py there). PATH is not searched: there the name would
find this entry point again.
"""
import os
import sys


def find_cli():
    here = os.path.dirname(os.path.abspath(__file__))
    candidates = []
    env = os.environ.get("KVATTN_LIB")
    if env:
        candidates.append(os.path.join(os.path.dirname(os.path.abspath(env)), "kvattn"))
    candidates.append(os.path.join(here, "kvattn", "_lib", "kvattn"))
    candidates.append(os.path.normpath(os.path.join(here, "..", "build", "kvattn")))
    for path in candidates:
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path, candidates
    return None, candidates


def main():
    path, tried = find_cli()
    if path is None:
        sys.stderr.write("kvattn: the kvattn program was not found; looked for %s. Reinstall the package "
                         "(pip install .) or run `make` in the source tree.\n" % ", ".join(tried))
        return 127
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(path, ["kvattn"] + sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
