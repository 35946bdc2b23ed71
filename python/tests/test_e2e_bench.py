"""bench/e2e_decode.py --quick on the CPU: tiny float32 Llama / Gemma 3 /
Qwen3-shaped models decode over a prefilled random context; the run writes
its table, JSON (and the PNG where matplotlib is importable), every format
measures, and the greedy tokens agree: kvattn over a float cache ("[exact
f32]" kernels) against sdpa, sdpa over DynamicCache against sdpa over
StaticCache, and the CUDA-graph path's StaticQuantCache
(run eagerly here) against KvattnQuantizedCache at 4 and 8 bits. Skipped
without torch, transformers or the torch extension (make torch-ext)."""
import importlib.util
import json
import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvattn import torch_ops  # noqa: E402

if not torch_ops.available():
    pytest.skip(torch_ops.load_error(), allow_module_level=True)

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench", "e2e_decode.py")


def _bench():
    spec = importlib.util.spec_from_file_location("e2e_decode", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("e2e")
    mod = _bench()
    # ctx 100 > the quick Gemma window (16): sliding layers apply the window;
    # the prefill in 5 update() calls of up to 24 rows (more than the window)
    result, rc = mod.main(["--quick", "--device", "cpu", "--batch", "2", "--ctx", "100", "--steps", "3",
                           "--chunk", "24", "--out", str(out)])
    return mod, result, rc, out


def test_outputs_written(run):
    mod, result, rc, out = run
    assert rc == 0
    md = (out / "e2e_decode.md").read_text()
    with open(out / "e2e_decode.json") as f:
        saved = json.load(f)
    assert len(saved["rows"]) == len(result["rows"])
    for name in mod.MODELS:
        for fmt in mod.FORMATS:
            rows = [r for r in result["rows"] if r["model"] == name and r["format"] == fmt and r["mode"] == "eager"]
            assert len(rows) == 1 and "skipped" not in rows[0], rows
            r = rows[0]
            assert r["tok_s"] > 0 and r["cache_bytes"] > 0 and 0 < r["attn_share"] <= 1
            assert "| %s | %d | 2 | 100 | %s | eager |" % (name, r["layers"], fmt) in md
        q4 = [r for r in result["rows"] if r["model"] == name and r["format"] == "kvattn-q4"][0]
        q8 = [r for r in result["rows"] if r["model"] == name and r["format"] == "kvattn-q8"][0]
        assert q4["cache_bytes"] < q8["cache_bytes"]
        # f32 model, group 64: an f32 scale and bias per 64 elements (8/64 bytes) beside 0.5 or 1 byte of codes
        assert q4["vs_bf16"] == pytest.approx(4 / (0.5 + 8 / 64), rel=1e-6)
        assert q8["vs_bf16"] == pytest.approx(4 / (1 + 8 / 64), rel=1e-6)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    png = (out / "e2e_decode.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def test_greedy_tokens_agree(run):
    mod, result, rc, out = run
    checks = result["checks"]
    for name in mod.MODELS:
        mine = [c for c in checks if c["model"] == name]
        kinds = sorted((tuple(c["a"]), tuple(c["b"])) for c in mine)
        assert kinds == sorted([(("kvattn-float", "eager"), ("sdpa-bf16", "eager")),
                                (("sdpa-bf16-dyn", "eager"), ("sdpa-bf16", "eager")),
                                (("kvattn-q8", "static"), ("kvattn-q8", "eager")),
                                (("kvattn-q4", "static"), ("kvattn-q4", "eager"))]), kinds
        for c in mine:
            assert c["ok"] and c["same"] and c["strict"], c["text"]
            assert len(c["tokens_a"]) == 1 + 3  # the warmup step and the timed ones
        f32 = [c for c in mine if c["a"][0] == "kvattn-float"][0]
        assert len(set(f32["tokens_a"])) > 1, "degenerate model: one token repeated %s" % f32["tokens_a"]


def test_check_detects_a_difference():
    mod = _bench()
    cell = {("kvattn-float", "eager"): dict(format="kvattn-float", tokens=[1, 2, 3]),
            ("sdpa-bf16", "eager"): dict(format="sdpa-bf16", tokens=[1, 2, 4])}
    (c,) = mod.check_cell(cell, "m", 1, 8)
    assert not c["ok"] and "DIFFER" in c["text"]
