"""The `kvattn` command-line tool (built next to the library by `make`):
`info`, one small checked `bench --json` case with the keys the issue asks
for, and bad arguments, each refused with exit status 2 and a message
naming the flag (no case runs)."""
import json
import os
import subprocess

import pytest

CLI = os.path.join(os.path.dirname(os.path.abspath(os.environ.get("KVATTN_LIB", "build/libkvattn.so"))), "kvattn")
pytestmark = pytest.mark.skipif(not os.access(CLI, os.X_OK), reason="kvattn CLI not built (make)")


def run(*args, timeout=120):
    return subprocess.run([CLI, *args], capture_output=True, text=True, timeout=timeout)


def test_info():
    r = run("info")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("kvattn ") and "cpu simd:" in r.stdout and "threads:" in r.stdout


def test_bench_json_case():
    r = run("bench", "--json", "--quiet", "--preset", "gemma3-4b", "--ctx", "1k", "--rows", "1", "--kv", "q4",
            "--reps", "3", "--rotate-gib", "0", "--threads", "1")
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 1
    c = rows[0]
    for key in ("op", "backend", "layout", "kv", "group", "heads", "kv_heads", "dim", "ctx", "rows", "batch",
                "threads", "us", "gbps", "bw_gbps", "bw_frac", "max_rel_err"):
        assert key in c, key
    assert (c["backend"], c["kv"], c["group"], c["heads"], c["kv_heads"], c["dim"], c["ctx"], c["rows"],
            c["threads"]) == ("cpu", "q4", 64, 8, 4, 256, 1024, 1, 1)
    assert c["status"] == "PASS" and c["us"] > 0 and 0 < c["max_rel_err"] < 1e-2


def test_bench_simd_portable():
    """--simd forces the CPU kernels' level: the portable one exists on every build."""
    r = run("bench", "--json", "--quiet", "--simd", "portable", "--preset", "gemma3-4b", "--ctx", "1k", "--rows",
            "1", "--kv", "q4", "--reps", "3", "--rotate-gib", "0", "--threads", "1")
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 1 and rows[0]["status"] == "PASS"
    assert rows[0]["kernel"] == "cpu portable fused kernel [exact f32]"


def test_bench_pattern():
    """--pattern times the kernels' read pattern without math beside each call (CPU, contiguous, over copies)."""
    r = run("bench", "--json", "--quiet", "--pattern", "--preset", "gemma3-4b", "--ctx", "1k", "--rows", "1",
            "--kv", "q4,bf16", "--reps", "3", "--rotate-gib", "0.01", "--threads", "1")
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 2 and all(c["status"] == "PASS" and c["copies"] >= 2 for c in rows)
    assert all(c["pattern_us"] > 0 for c in rows)
    t = run("bench", "--quiet", "--pattern", "--preset", "gemma3-4b", "--ctx", "1k", "--rows", "1", "--kv", "q4",
            "--reps", "3", "--rotate-gib", "0.01", "--threads", "1")
    assert t.returncode == 0, t.stderr
    assert "read pattern without math" in t.stdout and "us/pat" in t.stdout


def test_env_simd_cap():
    """KVATTN_SIMD caps the level for the whole process; an unknown name is ignored."""
    env = dict(os.environ, KVATTN_SIMD="portable")
    r = subprocess.run([CLI, "info"], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    assert "cpu simd: portable" in r.stdout
    plain = {k: v for k, v in os.environ.items() if k != "KVATTN_SIMD"}  # the best level (the suite may run capped)
    best = subprocess.run([CLI, "info"], capture_output=True, text=True, timeout=60, env=plain).stdout
    env["KVATTN_SIMD"] = "sse9"
    r = subprocess.run([CLI, "info"], capture_output=True, text=True, timeout=60, env=env)
    line = [x for x in best.splitlines() if x.startswith("cpu simd:")]
    assert line and line[0] in r.stdout


@pytest.mark.parametrize("args, needle", [
    (["nope"], "unknown command 'nope'"),
    (["bench", "--bogus"], "unknown option '--bogus'"),
    (["bench", "--ctx", "-1"], "--ctx"),
    (["bench", "--ctx", "1k,,2k"], "--ctx: empty item in '1k,,2k'"),
    (["bench", "--ctx", "4k,"], "--ctx: empty item"),
    (["bench", "--kv", "q3"], "--kv: 'q3' is not one of"),
    (["bench", "--kv", "q4,,bf16"], "--kv: empty item"),
    (["bench", "--preset", "nope"], "--preset: unknown preset 'nope'"),
    (["bench", "--preset", "gemma3-4b,"], "--preset: empty item"),
    (["bench", "--heads", "x"], "--heads"),
    (["bench", "--rows", "0"], "--rows"),
    (["bench", "--batch", "0"], "--batch"),
    (["bench", "--threads", "100000"], "--threads"),
    (["bench", "--group", "48"], "--group"),
    (["bench", "--reps", "-5"], "--reps"),
    (["bench", "--layout", "paged", "--block", "7"], "--block"),
    (["bench", "--ctx"], "--ctx"),
    (["bench", "--simd", "sse9"], "--simd: invalid argument: level \"sse9\""),
    (["bench", "--simd"], "--simd"),
    (["bench", "--pattern", "--layout", "paged"], "--pattern: the CPU backend over --layout contiguous only"),
    (["bench", "--pattern", "--backend", "cuda"], "--pattern: the CPU backend"),
    (["bench", "--pattern=1"], "--pattern takes no value"),
])
def test_bad_arguments(args, needle):
    r = run(*args, timeout=30)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert needle in r.stderr, r.stderr
