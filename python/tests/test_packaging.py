"""The PEP 517 backend (python/kvattn_build.py) behind `pip install .`: the
version from kvattn.h, its settings, the wheel's RECORD / WHEEL / METADATA /
entry points, the sdist's file list, and (test_pip_wheel_from_sdist_installs)
the whole path offline: sdist -> `pip wheel --no-index` with build isolation
(a CPU-only build from the unpacked sdist, about a minute on 2 cores) ->
install into a fresh venv -> import, attention against the oracle, the
`kvattn` entry point."""
import base64
import hashlib
import json
import os
import re
import subprocess
import sys
import tarfile
import zipfile

import pytest

import kvattn

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "python"))
import kvattn_build as kb  # noqa: E402


def test_version_is_the_headers_and_the_librarys():
    v = kb.read_version()
    assert re.fullmatch(r"\d+\.\d+\.\d+", v)
    assert v == kvattn.version()  # kva_version(): the same macros through the C compiler
    assert kvattn.__version__ == v


def test_version_parse(tmp_path):
    h = tmp_path / "kvattn.h"
    h.write_text("#define KVA_VERSION_MAJOR 12\n#  define  KVA_VERSION_MINOR\t07\n#define KVA_VERSION_PATCH 3\n"
                 "#define KVA_VERSION_HEX ((KVA_VERSION_MAJOR << 16))\n")
    assert kb.read_version(str(h)) == "12.7.3"
    h.write_text("#define KVA_VERSION_MAJOR 1\n#define KVA_VERSION_PATCH 3\n")
    with pytest.raises(kb.BuildError, match="KVA_VERSION_MINOR"):
        kb.read_version(str(h))
    h.write_text("#define KVA_VERSION_MAJOR 1\n#define KVA_VERSION_MINOR x\n#define KVA_VERSION_PATCH 3\n")
    with pytest.raises(kb.BuildError, match="KVA_VERSION_MINOR"):
        kb.read_version(str(h))


def test_settings(monkeypatch):
    for env in ("KVATTN_CUDA", "KVATTN_TORCH", "KVATTN_BUILD_DIR", "KVATTN_JOBS"):
        monkeypatch.delenv(env, raising=False)
    s = kb.settings()
    assert (s["cuda"], s["torch"], s["build-dir"]) == ("auto", "auto", "")
    assert isinstance(s["jobs"], int) and s["jobs"] >= 1
    monkeypatch.setenv("KVATTN_CUDA", "0")
    monkeypatch.setenv("KVATTN_JOBS", "3")
    monkeypatch.setenv("KVATTN_BUILD_DIR", "build-x")
    s = kb.settings()
    assert (s["cuda"], s["jobs"], s["build-dir"]) == ("0", 3, "build-x")
    assert kb.make_args(s, "/b") == ["make", "-j3", "BUILD=/b", "NVCC="]
    # a --config-settings key wins over the environment; the last of a repeated key
    s = kb.settings({"cuda": "on", "jobs": ["1", "2"], "build_dir": "b2", "torch": "no"})
    assert (s["cuda"], s["jobs"], s["build-dir"], s["torch"]) == ("1", 2, "b2", "0")
    for bad in ({"cuda": "maybe"}, {"torch": "2"}, {"jobs": "0"}, {"jobs": "x"}):
        with pytest.raises(kb.BuildError, match=list(bad)[0]):
            kb.settings(bad)
    monkeypatch.setenv("NVCC", "/nonexistent/nvcc")
    assert kb.make_args(kb.settings({"cuda": "1"}), "/b")[-1] == "NVCC=/nonexistent/nvcc"


def test_build_dir(monkeypatch, tmp_path):
    """No build-dir: make runs in a fresh temporary directory, removed after
    the wheel (or a failure); a given one is kept, relative to the source root."""
    seen = []

    def fake_build(s, d):
        seen.append((d, os.path.isdir(d)))
        if s["jobs"] == 1:
            raise kb.BuildError("stand-in failure")
        return {}

    monkeypatch.setattr(kb, "build_native", fake_build)
    monkeypatch.delenv("KVATTN_BUILD_DIR", raising=False)
    with kb.native_build({"jobs": "2"}):
        assert seen[-1][1]
    assert not os.path.exists(seen[-1][0])
    with pytest.raises(kb.BuildError):
        with kb.native_build({"jobs": "1"}):
            pass
    assert seen[-1][1] and not os.path.exists(seen[-1][0])
    with kb.native_build({"build-dir": "build-x/y", "jobs": "2"}):
        pass
    assert seen[-1][0] == os.path.join(kb.ROOT, "build-x", "y")
    with kb.native_build({"build-dir": str(tmp_path), "jobs": "2"}):
        pass
    assert seen[-1] == (str(tmp_path), True) and tmp_path.is_dir()


def check_record(zf):
    """Every member but RECORD listed once with its sha256 and size; RECORD itself with none."""
    names = zf.namelist()
    records = [n for n in names if n.endswith(".dist-info/RECORD")]
    assert len(records) == 1 and names[-1] == records[0]
    rows = [line.split(",") for line in zf.read(records[0]).decode().splitlines()]
    assert sorted(r[0] for r in rows) == sorted(names)
    for path, digest, size in rows:
        if path == records[0]:
            assert (digest, size) == ("", "")
            continue
        data = zf.read(path)
        assert digest == "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        assert int(size) == len(data)


def parse_metadata(text):
    head = text.split("\n\n", 1)[0]
    out = {}
    for line in head.splitlines():
        k, v = line.split(": ", 1)
        out.setdefault(k, []).append(v)
    return out


def check_dist_info(zf, version, tag=None):
    di = "kvattn-%s.dist-info/" % version
    meta = parse_metadata(zf.read(di + "METADATA").decode())
    assert meta["Name"] == ["kvattn"] and meta["Version"] == [version]
    assert meta["Requires-Python"] == [kb.REQUIRES_PYTHON]
    assert {"numpy", "ml_dtypes"} <= set(meta["Requires-Dist"])
    wheel = dict(line.split(": ", 1) for line in zf.read(di + "WHEEL").decode().splitlines())
    assert wheel["Wheel-Version"] == "1.0" and wheel["Root-Is-Purelib"] == "false"
    machine = os.uname().machine
    assert wheel["Tag"].endswith("-linux_" + machine), (wheel["Tag"], machine)
    if tag:
        assert wheel["Tag"] == tag
    eps = zf.read(di + "entry_points.txt").decode().splitlines()
    assert eps[0] == "[console_scripts]" and "kvattn = _kvattn_cli:main" in eps


def test_wheel_layout(tmp_path):
    """write_wheel over stand-in native files: package sources, kvattn/_lib/
    (the CLI executable), a correct RECORD, WHEEL and METADATA."""
    native = {}
    for name, mode in (("libkvattn.so", 0o755), ("kvattn", 0o755)):
        p = tmp_path / name
        p.write_bytes(os.urandom(1000) + name.encode())
        p.chmod(mode)
        native[name] = str(p)
    version = kb.read_version()
    name = kb.write_wheel(str(tmp_path / "out"), version, native)
    plat = "linux_" + os.uname().machine
    assert name == "kvattn-%s-py3-none-%s.whl" % (version, plat)
    with zipfile.ZipFile(tmp_path / "out" / name) as zf:
        check_record(zf)
        check_dist_info(zf, version, "py3-none-" + plat)
        names = set(zf.namelist())
        pkg = os.path.join(ROOT, "python", "kvattn")
        for f in os.listdir(pkg):
            if f.endswith(".py"):
                assert "kvattn/" + f in names
                with open(os.path.join(pkg, f), "rb") as src:
                    assert zf.read("kvattn/" + f) == src.read()
        assert "_kvattn_cli.py" in names
        assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc") or n.startswith("kvattn/csrc/")]
        for f, path in native.items():
            info = zf.getinfo("kvattn/_lib/" + f)
            assert info.external_attr >> 16 == 0o100755
            with open(path, "rb") as src:
                assert zf.read(info) == src.read()
        assert zf.getinfo("kvattn/__init__.py").external_attr >> 16 == 0o100644


def test_wheel_tag_with_torch_extension():
    tag = kb.wheel_tag(True)
    if sys.implementation.name == "cpython":
        assert tag.startswith("cp%d%d-cp%d%d" % (sys.version_info[:2] * 2))
    assert kb.wheel_tag(False).startswith("py3-none-linux_")


def test_sdist_contents(tmp_path):
    version = kb.read_version()
    name = kb.build_sdist(str(tmp_path))
    assert name == "kvattn-%s.tar.gz" % version
    with tarfile.open(tmp_path / name) as tf:
        names = tf.getnames()
        base = "kvattn-%s/" % version
        assert all(n.startswith(base) for n in names)
        rel = {n[len(base):] for n in names}
        for need in ("PKG-INFO", "pyproject.toml", "Makefile", "include/kvattn.h", "python/kvattn_build.py",
                     "python/kvattn/__init__.py", "python/kvattn/_capi.py", "python/_kvattn_cli.py",
                     "tools/kvattn.c", "src/api/attention.c", "python/README.md"):
            assert need in rel, need
        assert not [n for n in rel if n.startswith(("build/", "build-", "dist/", ".git/", "python/kvattn/_lib"))
                    or "__pycache__" in n or n.endswith((".pyc", ".o", ".so"))]
        meta = parse_metadata(tf.extractfile(base + "PKG-INFO").read().decode())
        assert meta["Name"] == ["kvattn"] and meta["Version"] == [version]


def test_missing_library_message(tmp_path):
    """Without a library anywhere, the import error names the places it looked."""
    pkg = tmp_path / "site" / "kvattn"
    pkg.mkdir(parents=True)
    src = os.path.join(ROOT, "python", "kvattn")
    for f in os.listdir(src):
        if f.endswith(".py"):
            (pkg / f).write_bytes(open(os.path.join(src, f), "rb").read())
    env = {k: v for k, v in os.environ.items() if k not in ("KVATTN_LIB", "PYTHONPATH", "LD_LIBRARY_PATH")}
    env["PYTHONPATH"] = str(tmp_path / "site")
    r = subprocess.run([sys.executable, "-c", "import kvattn"], capture_output=True, text=True, env=env,
                       cwd=str(tmp_path))
    if r.returncode == 0:
        pytest.skip("a libkvattn is on the system's library path")
    assert "ImportError" in r.stderr and "pip install ." in r.stderr and "KVATTN_LIB" in r.stderr
    assert os.path.join(str(pkg), "_lib", "libkvattn.so") in r.stderr


def clean_env():
    env = {k: v for k, v in os.environ.items()
           if k not in ("KVATTN_LIB", "PYTHONPATH", "KVATTN_BUILD_DIR", "PIP_REQUIRE_VIRTUALENV")}
    env.update(KVATTN_CUDA="0", KVATTN_TORCH="0", PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
    return env


PROBE = r"""
import json, os, sys
import numpy as np, kvattn
rng = np.random.default_rng(int(sys.argv[1]))
B, H, KVH, N, L, D = 2, 4, 2, 300, 3, 64
q = rng.standard_normal((B, H, L, D)).astype(np.float32)
k = rng.standard_normal((B, KVH, N, D)).astype(np.float32)
v = rng.standard_normal((B, KVH, N, D)).astype(np.float32)
out = kvattn.attention(q, k, v, mask="causal", exact=True)
ref = kvattn.reference_attention(q, k, v, mask="causal")
kq, vq = kvattn.quantize(k), kvattn.quantize(v)
out4 = kvattn.attention(q, kq, vq, mask="causal", exact=True)
ref4 = kvattn.reference_attention(q, kq, vq, mask="causal")
print(json.dumps(dict(pkg=kvattn.__file__, lib=kvattn._capi.LIB_PATH, version=kvattn.__version__,
                      kernel=kvattn.attention_kernel(q, k, v, mask="causal", exact=True),
                      err=float(np.abs(out.astype(np.float64) - ref).max()),
                      err4=float(np.abs(out4.astype(np.float64) - ref4).max()),
                      ref_max=float(np.abs(ref).max()))))
"""


def check_installed(py, env, cwd, version, pkg_dir):
    """In the venv of `py`, from cwd: kvattn is imported from pkg_dir with
    pkg_dir/_lib/libkvattn.so, and exact-f32 calls (float and 4-bit K/V) agree
    with the double-precision oracle on fresh random data."""
    seed = int.from_bytes(os.urandom(4), "little")
    r = subprocess.run([py, "-c", PROBE, str(seed)], capture_output=True, text=True, env=env, timeout=300,
                       cwd=str(cwd))
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.splitlines()[-1])
    assert os.path.realpath(got["pkg"]) == os.path.realpath(os.path.join(pkg_dir, "__init__.py")), got
    assert os.path.realpath(got["lib"]) == os.path.realpath(os.path.join(pkg_dir, "_lib", "libkvattn.so")), got
    assert got["version"] == version and got["kernel"].endswith("[exact f32]")
    # [exact f32] against the f64 oracle: kvref.COMPUTE_ATOL
    assert got["err"] <= 2e-6 and got["err4"] <= 2e-6, (got, seed)
    assert got["ref_max"] > 0.05


def check_cli(cli, env, version, tmp_path):
    r = subprocess.run([cli, "--version"], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "kvattn " + version, (r.stdout, r.stderr)
    r = subprocess.run([cli, "info"], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0 and r.stdout.startswith("kvattn %s" % version) and "CUDA: not built" in r.stdout
    r = subprocess.run([cli, "bench", "--no-such-flag"], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 2 and "--no-such-flag" in r.stderr  # the C program's own exit status and message
    # the command does not import the package: it runs when the library cannot be loaded
    r = subprocess.run([cli, "--version"], capture_output=True, text=True, timeout=60,
                       env=dict(env, KVATTN_LIB=str(tmp_path / "none" / "libkvattn.so")))
    assert r.returncode == 0 and r.stdout.strip() == "kvattn " + version, (r.stdout, r.stderr)


def test_pip_wheel_from_sdist_installs(tmp_path):
    """Offline, as on a machine without network: the sdist unpacked, `pip
    wheel --no-index` (build isolation on: the backend needs nothing
    installed; KVATTN_BUILD_DIR kept), the wheel installed with pip into a
    fresh venv that sees this interpreter's numpy and ml_dtypes, then, with no
    PYTHONPATH / KVATTN_LIB, from another directory: the package and library
    are the venv's, attention agrees with the oracle, the `kvattn` script runs
    the bundled CLI. Then `pip install -e` of the same tree over the same
    build directory (make finds it up to date): the package and library are
    the tree's."""
    import ml_dtypes
    import numpy

    version = kb.read_version()
    sdist = tmp_path / kb.build_sdist(str(tmp_path))
    with tarfile.open(sdist) as tf:
        tf.extractall(tmp_path / "src", **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    src = tmp_path / "src" / ("kvattn-%s" % version)
    env = dict(clean_env(), KVATTN_BUILD_DIR=str(tmp_path / "objs"), LC_ALL="C")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    py = str(venv / "bin" / "python")
    r = subprocess.run([py, "-m", "pip", "wheel", "--no-index", "--no-deps", "-w", str(tmp_path / "wheels"),
                        str(src)], capture_output=True, text=True, env=env, timeout=900, cwd=str(tmp_path))
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    wheels = os.listdir(tmp_path / "wheels")
    assert wheels == ["kvattn-%s-py3-none-linux_%s.whl" % (version, os.uname().machine)]
    whl = tmp_path / "wheels" / wheels[0]
    with zipfile.ZipFile(whl) as zf:
        check_record(zf)
        check_dist_info(zf, version)
        assert {"kvattn/_lib/libkvattn.so", "kvattn/_lib/kvattn"} <= set(zf.namelist())
    assert os.path.exists(tmp_path / "objs" / "libkvattn.so")

    # numpy and ml_dtypes from this interpreter's site-packages (no index to install them from)
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    dep_dirs = sorted({os.path.dirname(os.path.dirname(m.__file__)) for m in (numpy, ml_dtypes)})
    with open(os.path.join(site, "zz_test_deps.pth"), "w") as f:
        f.write("\n".join(dep_dirs) + "\n")
    r = subprocess.run([py, "-m", "pip", "install", "--no-index", str(whl)], capture_output=True, text=True,
                       env=env, timeout=300, cwd=str(tmp_path))
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    check_installed(py, env, tmp_path, version, os.path.join(site, "kvattn"))
    check_cli(str(venv / "bin" / "kvattn"), env, version, tmp_path)

    r = subprocess.run([py, "-m", "pip", "install", "-v", "--no-index", "-e", str(src)], capture_output=True,
                       text=True, env=env, timeout=300, cwd=str(tmp_path))
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "libkvattn.so' is up to date" in r.stdout + r.stderr  # the kept build directory, reused
    assert not os.path.exists(os.path.join(site, "kvattn"))
    check_installed(py, env, tmp_path, version, os.path.join(str(src), "python", "kvattn"))
    check_cli(str(venv / "bin" / "kvattn"), env, version, tmp_path)


def test_wheel_with_torch_extension(tmp_path):
    """Where torch imports (so not in CI): the backend run by this
    interpreter (as `pip install --no-build-isolation` runs it) with
    KVATTN_TORCH=1, CPU only, builds libkvattn_torch.so into kvattn/_lib/
    under a cpXY tag; installed into a fresh venv that sees this
    interpreter's torch, kvattn.torch_ops loads it from there and its
    attention agrees with the oracle."""
    torch = pytest.importorskip("torch")
    import ml_dtypes
    import numpy

    version = kb.read_version()
    env = dict(clean_env(), KVATTN_TORCH="1")
    code = "import sys; sys.path.insert(0, 'python'); import kvattn_build as b; print(b.build_wheel(sys.argv[1]))"
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "wheels")], capture_output=True, text=True,
                       env=env, timeout=1200, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    name = r.stdout.split()[-1]
    tag = kb.wheel_tag(True)
    assert name == "kvattn-%s-%s.whl" % (version, tag)
    whl = tmp_path / "wheels" / name
    with zipfile.ZipFile(whl) as zf:
        check_record(zf)
        check_dist_info(zf, version, tag)
        assert "kvattn/_lib/libkvattn_torch.so" in zf.namelist()

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    py = str(venv / "bin" / "python")
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    dep_dirs = sorted({os.path.dirname(os.path.dirname(m.__file__)) for m in (numpy, ml_dtypes, torch)})
    with open(os.path.join(site, "zz_test_deps.pth"), "w") as f:
        f.write("\n".join(dep_dirs) + "\n")
    r = subprocess.run([py, "-m", "pip", "install", "--no-index", "--no-deps", str(whl)], capture_output=True,
                       text=True, env=env, timeout=300, cwd=str(tmp_path))
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    probe = r"""
import json, sys
import numpy as np, torch, kvattn, kvattn.torch_ops as t
torch.manual_seed(int(sys.argv[1]))
q = torch.randn(2, 8, 3, 64); k = torch.randn(2, 2, 500, 64); v = torch.randn(2, 2, 500, 64)
out = t.load().attention(q, k, v, causal=True, exact=True)
ref = kvattn.reference_attention(q.numpy(), k.numpy(), v.numpy(), mask="causal")
print(json.dumps(dict(ext=t.library_path(), err=float(np.abs(out.numpy().astype(np.float64) - ref).max()))))
"""
    seed = int.from_bytes(os.urandom(4), "little")
    r = subprocess.run([py, "-c", probe, str(seed)], capture_output=True, text=True, env=env, timeout=300,
                       cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.splitlines()[-1])
    assert os.path.realpath(got["ext"]) == os.path.realpath(os.path.join(site, "kvattn", "_lib", "libkvattn_torch.so"))
    assert got["err"] <= 2e-6, (got, seed)  # [exact f32] against the f64 oracle: kvref.COMPUTE_ATOL
