"""PEP 517 / PEP 660 build backend for kvattn, standard library only.

pyproject.toml names it (`backend-path = ["python"]`), so `pip install .`
needs nothing downloaded to build: no setuptools, no wheel package. A wheel
is built by running the project's own Makefile:

    make -jN BUILD=<dir> <dir>/libkvattn.so <dir>/kvattn    [NVCC= when CUDA is off]
    make -jN BUILD=<dir> torch-ext                          (when torch imports and the target exists)

and zipping python/kvattn/ with the results in kvattn/_lib/ (libkvattn.so,
the `kvattn` CLI, libkvattn_torch.so when built). The version is the
KVA_VERSION_MAJOR/MINOR/PATCH of include/kvattn.h.

Settings, each an environment variable or a `--config-settings` key of the
same meaning (`pip install . --config-settings cuda=0`; a config setting
wins over the environment):

    KVATTN_CUDA       cuda       auto (default: the Makefile's, nvcc from PATH or
                                 /usr/local/cuda/bin/nvcc), 0 (CPU only, NVCC=), 1 (CUDA
                                 required: the build fails without nvcc)
    KVATTN_TORCH      torch      auto (default: build the torch extension when `import torch`
                                 works in the build environment and `make -n torch-ext`
                                 succeeds; a failure only leaves it out), 0 (never), 1 (required)
    KVATTN_BUILD_DIR  build-dir  the make BUILD directory (relative to the source root);
                                 default a fresh temporary one, removed afterwards. A kept one
                                 makes rebuilds incremental; it must have been built with the
                                 same CUDA setting (one BUILD directory per configuration).
    KVATTN_JOBS       jobs       make -j (default: the CPUs this process may use)

CC, CFLAGS, NVCC and CUDA_ARCH reach make through the environment as usual.
"""
import base64
import gzip
import hashlib
import io
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAME = "kvattn"
SUMMARY = "Fused attention over quantized (MLX affine 2/4/8-bit) and paged KV caches, CPU and CUDA"
REQUIRES_PYTHON = ">=3.9"
REQUIRES = ["numpy", "ml_dtypes"]
EXTRAS = {
    "torch": ["torch"],
    "transformers": ["torch", "transformers"],
    "test": ["pytest"],
}
ENTRY_POINTS = {"console_scripts": {"kvattn": "_kvattn_cli:main"}}
TOP_MODULES = ("_kvattn_cli.py",)         # python/*.py installed beside the package
LIB_FILES = ("libkvattn.so", "kvattn")  # always in kvattn/_lib/
TORCH_LIB = "libkvattn_torch.so"        # in kvattn/_lib/ when built
# Fixed zip timestamps (or SOURCE_DATE_EPOCH's): the same tree gives the same wheel.
ZIP_EPOCH = (1980, 1, 1, 0, 0, 0)


class BuildError(RuntimeError):
    pass


def log(msg):
    print("kvattn build: " + msg, file=sys.stderr, flush=True)


# ------------------------------------------------------------------ version


def read_version(header=None):
    """"MAJOR.MINOR.PATCH" from the KVA_VERSION_* macros of include/kvattn.h."""
    header = header or os.path.join(ROOT, "include", "kvattn.h")
    with open(header, encoding="utf-8") as f:
        text = f.read()
    parts = []
    for key in ("MAJOR", "MINOR", "PATCH"):
        m = re.search(r"^[ \t]*#[ \t]*define[ \t]+KVA_VERSION_%s[ \t]+(\d+)[ \t]*$" % key, text, re.M)
        if not m:
            raise BuildError("%s: no `#define KVA_VERSION_%s <number>`" % (header, key))
        parts.append(str(int(m.group(1))))
    return ".".join(parts)


# ----------------------------------------------------------------- settings


def settings(config_settings=None):
    """The build settings: config_settings over the environment over the defaults."""
    cs = config_settings or {}
    spec = (("cuda", "KVATTN_CUDA", "auto"), ("torch", "KVATTN_TORCH", "auto"),
            ("build-dir", "KVATTN_BUILD_DIR", ""), ("jobs", "KVATTN_JOBS", ""))
    out = {}
    for key, env, default in spec:
        value = cs.get(key, cs.get(key.replace("-", "_")))
        if isinstance(value, list):  # a key given twice: the last wins
            value = value[-1]
        if value is None:
            value = os.environ.get(env, default)
        out[key] = str(value).strip()
    for key in ("cuda", "torch"):
        v = out[key].lower()
        v = {"": "auto", "on": "1", "yes": "1", "true": "1", "off": "0", "no": "0", "false": "0"}.get(v, v)
        if v not in ("auto", "0", "1"):
            raise BuildError("%s=%r: expected auto, 0 or 1" % (key, out[key]))
        out[key] = v
    jobs = out["jobs"]
    if jobs:
        if not jobs.isdigit() or int(jobs) < 1:
            raise BuildError("jobs=%r: expected a positive integer" % jobs)
        out["jobs"] = int(jobs)
    else:
        try:
            out["jobs"] = max(1, len(os.sched_getaffinity(0)))
        except AttributeError:
            out["jobs"] = max(1, os.cpu_count() or 1)
    return out


def find_nvcc():
    """The nvcc the Makefile would take: $NVCC, else PATH, else /usr/local/cuda/bin/nvcc."""
    env = os.environ.get("NVCC")
    if env:
        return env
    found = shutil.which("nvcc")
    if found:
        return found
    default = "/usr/local/cuda/bin/nvcc"
    return default if os.access(default, os.X_OK) else ""


def make_args(s, build_dir):
    args = ["make", "-j%d" % s["jobs"], "BUILD=" + build_dir]
    if s["cuda"] == "0":
        args.append("NVCC=")
    elif s["cuda"] == "1":
        nvcc = find_nvcc()
        if not nvcc:
            raise BuildError("cuda=1 but no nvcc ($NVCC, PATH, /usr/local/cuda/bin/nvcc)")
        args.append("NVCC=" + nvcc)
    return args


# -------------------------------------------------------------------- build


def run(cmd, **kw):
    log("$ " + " ".join(cmd))
    # make's output goes to stderr: pip shows it on failure (and with -v).
    try:
        return subprocess.run(cmd, cwd=ROOT, stdout=sys.stderr, stderr=sys.stderr, **kw)
    except FileNotFoundError:
        raise BuildError("%s not found: building kvattn needs make and a C compiler (gcc or clang)" % cmd[0])


def torch_importable():
    r = subprocess.run([sys.executable, "-c", "import torch"], cwd=tempfile.gettempdir(),
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return r.returncode == 0


def check_library(lib_path, cli_path, version):
    """Loads the built library (every symbol bound now) and runs the CLI: both
    must report the header's version."""
    probe = ("import ctypes, sys\n"
             "lib = ctypes.CDLL(sys.argv[1])  # ctypes binds every symbol now (RTLD_NOW)\n"
             "lib.kva_version.restype = ctypes.c_char_p\n"
             "print(lib.kva_version().decode())\n")
    r = subprocess.run([sys.executable, "-c", probe, lib_path], capture_output=True, text=True)
    if r.returncode != 0 or r.stdout.strip() != version:
        raise BuildError("%s does not load or reports a version other than %s:\n%s%s"
                         % (lib_path, version, r.stdout, r.stderr))
    r = subprocess.run([cli_path, "--version"], capture_output=True, text=True)
    if r.returncode != 0 or r.stdout.split()[-1:] != [version]:
        raise BuildError("`%s --version` failed or reports a version other than %s:\n%s%s"
                         % (cli_path, version, r.stdout, r.stderr))


def build_native(s, build_dir):
    """Runs make in build_dir; returns {name in kvattn/_lib: built path}."""
    version = read_version()
    base = make_args(s, build_dir)
    targets = [os.path.join(build_dir, f) for f in LIB_FILES]
    if run(base + targets).returncode != 0:
        raise BuildError("make failed (its output is above)")
    check_library(targets[0], targets[1], version)
    out = dict(zip(LIB_FILES, targets))

    if s["torch"] != "0":
        # the extension is compiled against the torch of the interpreter running this backend
        torch_args = base + ["TORCH_PY=" + sys.executable]
        why = None
        if not torch_importable():
            why = "`import torch` fails in the build environment (%s)" % sys.executable
        elif subprocess.run(torch_args + ["-n", "torch-ext"], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL).returncode != 0:
            why = "the Makefile has no buildable torch-ext target"
        elif run(torch_args + ["torch-ext"]).returncode != 0:
            why = "make torch-ext failed (its output is above)"
        elif not os.path.exists(os.path.join(build_dir, TORCH_LIB)):
            why = "make torch-ext did not produce %s" % TORCH_LIB
        if why is None:
            out[TORCH_LIB] = os.path.join(build_dir, TORCH_LIB)
        elif s["torch"] == "1":
            raise BuildError("torch=1 but " + why)
        else:
            log("torch extension left out: " + why)
    return out


class native_build:
    """Context manager: the native artifacts, built in the configured BUILD
    directory or a temporary one removed on exit."""

    def __init__(self, config_settings):
        self.s = settings(config_settings)
        self.tmp = None

    def __enter__(self):
        d = self.s["build-dir"]
        if d:
            d = os.path.join(ROOT, d) if not os.path.isabs(d) else d
        else:
            self.tmp = d = tempfile.mkdtemp(prefix="kvattn-build-")
        try:
            return build_native(self.s, os.path.abspath(d))
        except BaseException:  # __exit__ does not run when __enter__ raises
            self.__exit__()
            raise

    def __exit__(self, *exc):
        if self.tmp:
            shutil.rmtree(self.tmp, ignore_errors=True)


# ----------------------------------------------------------------- metadata


def dist_info_name(version):
    return "%s-%s.dist-info" % (NAME, version)


def metadata_text(version):
    lines = ["Metadata-Version: 2.1", "Name: " + NAME, "Version: " + version, "Summary: " + SUMMARY,
             "Requires-Python: " + REQUIRES_PYTHON]
    lines += ["Requires-Dist: " + r for r in REQUIRES]
    for extra, reqs in EXTRAS.items():
        lines.append("Provides-Extra: " + extra)
        lines += ['Requires-Dist: %s; extra == "%s"' % (r, extra) for r in reqs]
    lines.append("Description-Content-Type: text/markdown")
    readme = os.path.join(ROOT, "python", "README.md")
    body = ""
    if os.path.exists(readme):
        with open(readme, encoding="utf-8") as f:
            body = f.read()
    return "\n".join(lines) + "\n\n" + body


def entry_points_text():
    out = []
    for group, items in ENTRY_POINTS.items():
        out.append("[%s]" % group)
        out += ["%s = %s" % kv for kv in items.items()]
        out.append("")
    return "\n".join(out)


def wheel_tag(has_torch_ext):
    """py3-none-<platform> (the library is loaded through ctypes, so any Python
    3 ABI can use it); cpXY-cpXY-<platform> when the torch extension is in,
    which is built against one interpreter's torch."""
    plat = sysconfig.get_platform().replace("-", "_").replace(".", "_")
    if not plat.startswith("linux_"):
        raise BuildError("platform %r: kvattn builds on Linux only" % plat)
    if has_torch_ext and sys.implementation.name == "cpython":
        py = "cp%d%d" % sys.version_info[:2]
        abi = py + ("t" if sysconfig.get_config_var("Py_GIL_DISABLED") else "")
        return "%s-%s-%s" % (py, abi, plat)
    return "py3-none-" + plat


def wheel_text(tag):
    return ("Wheel-Version: 1.0\nGenerator: kvattn_build (python/kvattn_build.py)\n"
            "Root-Is-Purelib: false\nTag: %s\n" % tag)


def write_metadata_dir(parent, version):
    d = os.path.join(parent, dist_info_name(version))
    os.makedirs(d, exist_ok=True)
    for name, text in (("METADATA", metadata_text(version)), ("entry_points.txt", entry_points_text())):
        with open(os.path.join(d, name), "w", encoding="utf-8") as f:
            f.write(text)
    return os.path.basename(d)


# -------------------------------------------------------------------- wheel


def record_hash(data):
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def zip_time():
    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    if epoch and epoch.isdigit():
        import time
        t = time.gmtime(max(int(epoch), 315532800))  # zip cannot store times before 1980
        return t[:6]
    return ZIP_EPOCH


class WheelWriter:
    """Writes a wheel: each file added with its RECORD line; RECORD last."""

    def __init__(self, path, dist_info):
        self.zf = zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED)
        self.dist_info = dist_info
        self.records = []
        self.time = zip_time()

    def add(self, arcname, data, executable=False):
        if isinstance(data, str):
            data = data.encode("utf-8")
        info = zipfile.ZipInfo(arcname, self.time)
        info.external_attr = (0o100755 if executable else 0o100644) << 16
        info.compress_type = zipfile.ZIP_DEFLATED
        self.zf.writestr(info, data)
        self.records.append((arcname, record_hash(data), str(len(data))))

    def add_file(self, arcname, path):
        with open(path, "rb") as f:
            data = f.read()
        self.add(arcname, data, executable=os.access(path, os.X_OK))

    def close(self):
        record = self.dist_info + "/RECORD"
        buf = io.StringIO()
        for row in self.records + [(record, "", "")]:
            buf.write(",".join(_csv_field(x) for x in row) + "\n")
        info = zipfile.ZipInfo(record, self.time)
        info.external_attr = 0o100644 << 16
        info.compress_type = zipfile.ZIP_DEFLATED
        self.zf.writestr(info, buf.getvalue())
        self.zf.close()


def _csv_field(x):
    return '"%s"' % x.replace('"', '""') if any(c in x for c in ',"\n') else x


# Top-level folders of python/kvattn/ that stay out of the wheel: an editable
# install's staging (_lib/, the wheel gets fresh files there) and the torch
# extension's sources (csrc/, compiled by make torch-ext; in the sdist).
_WHEEL_SKIP_DIRS = ("_lib", "csrc")


def package_files():
    """(arcname, path) of TOP_MODULES and python/kvattn/ (sources and data),
    without caches and _WHEEL_SKIP_DIRS."""
    pkg = os.path.join(ROOT, "python", NAME)
    out = [(m, os.path.join(ROOT, "python", m)) for m in TOP_MODULES]
    for d, dirs, files in os.walk(pkg):
        rel = os.path.relpath(d, pkg)
        dirs[:] = sorted(x for x in dirs if x != "__pycache__" and not (rel == "." and x in _WHEEL_SKIP_DIRS))
        for f in sorted(files):
            if f.endswith((".pyc", ".pyo")):
                continue
            path = os.path.join(d, f)
            out.append(("/".join(p for p in (NAME, rel.replace(os.sep, "/"), f) if p != "."), path))
    return out


def write_wheel(wheel_directory, version, native, extra=None):
    """The wheel: dist-info files, python/kvattn/ (unless extra replaces the
    package by an editable hook) and native under kvattn/_lib/."""
    tag = wheel_tag(TORCH_LIB in native)
    name = "%s-%s-%s.whl" % (NAME, version, tag)
    dist_info = dist_info_name(version)
    os.makedirs(wheel_directory, exist_ok=True)
    w = WheelWriter(os.path.join(wheel_directory, name), dist_info)
    if extra is None:
        for arcname, path in package_files():
            w.add_file(arcname, path)
        for f in sorted(native):
            w.add_file("%s/_lib/%s" % (NAME, f), native[f])
    else:
        for arcname, data in extra:
            w.add(arcname, data)
    w.add(dist_info + "/METADATA", metadata_text(version))
    w.add(dist_info + "/WHEEL", wheel_text(tag))
    w.add(dist_info + "/entry_points.txt", entry_points_text())
    w.close()
    log("wrote " + name)
    return name


# ---------------------------------------------------------------- PEP 517


def get_requires_for_build_wheel(config_settings=None):
    return []


def get_requires_for_build_sdist(config_settings=None):
    return []


def get_requires_for_build_editable(config_settings=None):
    return []


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    return write_metadata_dir(metadata_directory, read_version())


prepare_metadata_for_build_editable = prepare_metadata_for_build_wheel


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    version = read_version()
    with native_build(config_settings) as native:
        return write_wheel(wheel_directory, version, native)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    """PEP 660: the native files are built and copied to python/kvattn/_lib/
    (ignored by git, removed by `make clean`); the wheel holds a .pth that puts
    python/ on sys.path, so edits to the package take effect without a
    reinstall (a change to the C sources needs `pip install -e .` again)."""
    version = read_version()
    lib_dir = os.path.join(ROOT, "python", NAME, "_lib")
    with native_build(config_settings) as native:
        shutil.rmtree(lib_dir, ignore_errors=True)
        os.makedirs(lib_dir)
        for f, path in native.items():
            shutil.copy2(path, os.path.join(lib_dir, f))
        pth = os.path.join(ROOT, "python") + "\n"
        return write_wheel(wheel_directory, version, native, extra=[("__editable__.%s.pth" % NAME, pth)])


# -------------------------------------------------------------------- sdist

# Never in an sdist, whatever git says: build outputs and caches.
_SDIST_SKIP_DIRS = {".git", "__pycache__", ".pytest_cache", ".venv", "dist", "_lib"}


def sdist_files():
    """Source-root-relative paths: git's tracked and unignored files when this is
    a git checkout, else every file outside build directories and caches."""
    if os.path.exists(os.path.join(ROOT, ".git")):  # a folder, or a file in a worktree
        try:
            r = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                               cwd=ROOT, capture_output=True)
        except OSError:  # no git: the walk below
            r = None
        if r is not None and r.returncode == 0:
            names = sorted({n for n in r.stdout.decode().split("\0") if n})
            return [n for n in names if os.path.isfile(os.path.join(ROOT, n)) and
                    not (set(n.split("/")[:-1]) & _SDIST_SKIP_DIRS) and not n.endswith(".pyc")]
    out = []
    for d, dirs, files in os.walk(ROOT):
        rel = os.path.relpath(d, ROOT)
        dirs[:] = sorted(x for x in dirs if x not in _SDIST_SKIP_DIRS and
                         not (rel == "." and (x == "build" or x.startswith("build-"))))
        for f in sorted(files):
            if not f.endswith((".pyc", ".o")):
                out.append(os.path.normpath(os.path.join(rel, f)).replace(os.sep, "/"))
    return out


def build_sdist(sdist_directory, config_settings=None):
    version = read_version()
    base = "%s-%s" % (NAME, version)
    name = base + ".tar.gz"
    os.makedirs(sdist_directory, exist_ok=True)
    mtime = 315532800
    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    if epoch and epoch.isdigit():
        mtime = int(epoch)

    def add(tf, arcname, data, mode):
        info = tarfile.TarInfo(arcname)
        info.size, info.mode, info.mtime = len(data), mode, mtime
        info.uname = info.gname = ""
        tf.addfile(info, io.BytesIO(data))

    path = os.path.join(sdist_directory, name)
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=mtime, filename="") as gz, \
            tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tf:
        add(tf, base + "/PKG-INFO", metadata_text(version).encode("utf-8"), 0o644)
        for rel in sdist_files():
            if rel == "PKG-INFO":
                continue
            full = os.path.join(ROOT, rel)
            with open(full, "rb") as f:
                data = f.read()
            add(tf, base + "/" + rel, data, 0o755 if os.access(full, os.X_OK) else 0o644)
    log("wrote " + name)
    return name
