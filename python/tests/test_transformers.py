"""kvattn.integrations.transformers on random-initialized tiny models built
from configs (nothing downloaded), torch CPU tensors (CUDA too where a GPU
is present), float32:

- logits of "kvattn" (exact=True: f32 kernels on any machine) against
  "sdpa" (where the model does not take sdpa, softcap or sinks: its eager
  attention in float64) and "eager", over a left-padded prefill (explicit
  masks), two decode steps over a DynamicCache and an unpadded prefill (no
  mask: kvattn's causal mask and window), within 4x the spread that the two
  references show against each other in the same test (floor 1e-5);
- the default kernels (whatever this machine selects: AMX, integer q.k,
  tensor cores) through Oracle: every attention call checked against the
  model's eager attention in float64 on the same q, K, V, within the
  kernel's arithmetic allowance (test_torch_ops' atol_of);
- greedy generate: exact-kernel tokens equal eager's; the default kernels
  generate through Oracle;
- KvattnQuantizedCache (4 and 8 bits): packed words bit for bit
  kvattn.quantize of the rows update() received; every attention call over
  the packed cache checked by Oracle against eager over the dequantized
  cache; generate(past_key_values=KvattnQuantizedCache) decodes over it.

Models, where the installed transformers has their configs: Llama (GQA),
Gemma 2 (softcap + sliding window), Gemma 3 (local/global layers),
Qwen 2, Qwen 3, gpt-oss (sinks, sliding window). Skipped when torch,
transformers or the torch extension (make torch-ext) is missing."""
import importlib

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import kvattn  # noqa: E402
from kvattn import torch_ops  # noqa: E402
from kvref import BF16_PRODUCTS_ATOL, COMPUTE_ATOL  # noqa: E402

if not torch_ops.available():
    pytest.skip(torch_ops.load_error(), allow_module_level=True)

kt = importlib.import_module("kvattn.integrations.transformers")
kt.register("kvattn_exact", exact=True)
from transformers import AttentionInterface  # noqa: E402
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() and kvattn.cuda_device_count() > 0 else [])

# f32 models: sdpa and eager differ by summation order only (1.5e-7 to
# 4.8e-7 on these logits, CPU); kvattn's exact mode differed from them by at
# most 1.6x that spread, so the bound is the larger of the measured spread
# times this factor and a floor of ~80 f32 ulps at logits of magnitude ~1 (a
# 0.1 % error in one layer's attention is well above it).
SPREAD_FACTOR = 4.0
F32_FLOOR = 1e-5


def _common(**kw):
    d = dict(vocab_size=128, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
             tie_word_embeddings=False)
    d.update(kw)
    return d


def _config(name):
    """(config class name, kwargs) of each model; None when the installed
    transformers lacks it."""
    specs = {
        "llama": ("LlamaConfig", _common()),
        "gemma2": ("Gemma2Config", _common(sliding_window=8, attn_logit_softcapping=0.5,
                                             final_logit_softcapping=30.0, query_pre_attn_scalar=64,
                                             layer_types=["sliding_attention", "full_attention"])),
        "gemma3": ("Gemma3TextConfig", _common(sliding_window=8, query_pre_attn_scalar=64,
                                                layer_types=["sliding_attention", "full_attention"])),
        "qwen2": ("Qwen2Config", _common(use_sliding_window=False)),
        "qwen3": ("Qwen3Config", _common()),
        "gpt_oss": ("GptOssConfig", _common(sliding_window=8, num_local_experts=4, num_experts_per_tok=2,
                                            layer_types=["sliding_attention", "full_attention"])),
    }
    cls_name, kw = specs[name]
    cls = getattr(transformers, cls_name, None)
    if cls is None:
        return None
    return cls(**kw)


MODELS = ["llama", "gemma2", "gemma3", "qwen2", "qwen3", "gpt_oss"]


def _build(name, impl, device, seed=0):
    cfg = _config(name)
    if cfg is None:
        pytest.skip("transformers %s has no config for %s" % (transformers.__version__, name))
    torch.manual_seed(seed)
    if name == "gemma3":
        model = transformers.Gemma3ForCausalLM(cfg)
    else:
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    model = model.to(device=device, dtype=torch.float32).eval()
    model.set_attn_implementation(impl)
    if name == "gpt_oss":  # sinks start at zero: give them weight
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(0.0, 1.0)
    return model


def _register_eager64(model, impl):
    """AttentionInterface `impl`: the model's own eager attention on
    float64 copies of q, K, V, the mask and the sinks, rounded back to the
    query's dtype; rows that see no key (padding) give zeros."""
    eager = _eager_fn(model)

    def fn(module, query, key, value, attention_mask, **kwargs):
        d = torch.float64
        if attention_mask is not None:
            attention_mask = attention_mask.to(d)
        if "s_aux" in kwargs and kwargs["s_aux"] is not None:
            kwargs["s_aux"] = kwargs["s_aux"].to(d)
        sinks = getattr(module, "sinks", None)
        if sinks is not None:
            module.sinks.data = sinks.data.to(d)
        try:
            o, w = eager(module, query.to(d), key.to(d), value.to(d), attention_mask, **kwargs)
        finally:
            if sinks is not None:
                module.sinks.data = sinks.data.to(query.dtype)
        return torch.nan_to_num(o, nan=0.0).to(query.dtype), None

    AttentionInterface.register(impl, fn)
    AttentionMaskInterface.register(impl, eager_mask)


_models = {}


def models(name, device):
    """The same weights under eager, the second reference ("sdpa" or
    "eager64"), "kvattn_exact" and "oracle" (the default kernels, checked
    call by call)."""
    key = (name, device)
    if key not in _models:
        base = _build(name, "eager", device)
        state = base.state_dict()
        out = {"eager": base}
        # sdpa where the model takes it (not with softcap or sinks), else
        # the model's eager attention computed in float64: the second
        # reference that sets the spread
        second = "sdpa" if type(base)._supports_sdpa else "eager64"
        impls = {second: second, "kvattn_exact": "kvattn_exact", "oracle": "kvattn_oracle_" + name}
        if second == "eager64":
            impls[second] = "eager64_" + name
            _register_eager64(base, impls[second])
        oracle = Oracle(base, device)
        AttentionInterface.register(impls["oracle"], oracle)
        AttentionMaskInterface.register(impls["oracle"], kt.kvattn_mask)
        for role, impl in impls.items():
            m = _build(name, impl, device, seed=1)
            m.load_state_dict(state)
            out[role] = m
        out["oracle_fn"] = oracle
        _models[key] = out
    return _models[key]


def _inputs(device, B=2, L=20, pad=5, seed=3):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 128, (B, L), generator=g)
    mask = torch.ones(B, L, dtype=torch.long)
    mask[1, :pad] = 0  # left padding in the second sequence
    return ids.to(device), mask.to(device)


def _logits(model, ids, mask, cache=None):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=cache is not None)


def _maxdiff(a, b, mask=None):
    d = (a.float() - b.float()).abs()
    if mask is not None:
        d = d[mask.bool()]
    return d.max().item()


def _bound(spread):
    return max(SPREAD_FACTOR * spread, F32_FLOOR)


@pytest.fixture(autouse=True)
def no_fallback(request):
    """Every kvattn attention call ran the kernel, not the torch fallback
    (except in the tests that exercise it)."""
    kt.fallbacks.clear()
    yield
    if "fallback" not in request.node.name:
        assert not kt.fallbacks, dict(kt.fallbacks)


def _next(res, impl, steps):
    """The next input tokens: eager's greedy choice at this step, so that
    every implementation decodes the same tokens."""
    return (steps if impl == "eager" else res["eager"])[len(steps) - 1][:, -1:].argmax(-1)


def test_registered():
    assert AttentionInterface._global_mapping["kvattn"] is kt.kvattn_attention_forward
    assert AttentionMaskInterface._global_mapping["kvattn"] is kt.kvattn_mask


@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_static_cache(name):
    """A StaticCache (keys preallocated past the prompt): an unpadded
    prefill, where transformers gives no mask and the keys past the
    prompt are not written yet, then decode steps, as eager does."""
    device = DEVICES[-1]
    ms = models(name, device)
    ids = _inputs(device)[0][:1]
    out = {}
    for impl in ("eager", "kvattn_exact", "oracle"):
        m = ms[impl]
        cache = transformers.StaticCache(config=m.config, max_cache_len=40)
        x, steps = ids, []
        for _ in range(3):  # no attention_mask: the prefill's mask is None
            with torch.no_grad():
                lg = m(input_ids=x, past_key_values=cache, use_cache=True).logits
            steps.append(lg)
            x = lg[:, -1:].argmax(-1)
        out[impl] = steps
    # "oracle" (default kernels) was checked call by call
    for a, b in zip(out["kvattn_exact"], out["eager"]):
        assert _maxdiff(a, b) <= F32_FLOOR


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_bf16_logits(name, device):
    """bf16 models, the default kernels: logits within twice the spread
    between bf16 eager and bf16 sdpa (prefill of a padded batch, then a
    decode step)."""
    ms = models(name, device)
    ids, mask = _inputs(device)
    res = {}
    for impl in ("eager", "sdpa", "kvattn"):
        m = _build(name, impl, device, seed=1)
        m.load_state_dict(ms["eager"].state_dict())
        m = m.to(torch.bfloat16)
        cache = transformers.DynamicCache(config=m.config)
        with torch.no_grad():
            a = m(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True).logits
            mk = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            b = m(input_ids=a[:, -1:].argmax(-1) if impl == "eager" else res["eager"][2], attention_mask=mk,
                  past_key_values=cache, use_cache=True).logits
        res[impl] = (a.float(), b.float(), a[:, -1:].argmax(-1) if impl == "eager" else None)
    for i, valid in ((0, mask), (1, None)):
        e, s, k = res["eager"][i], res["sdpa"][i], res["kvattn"][i]
        spread = _maxdiff(e, s, valid)
        assert spread > 0
        assert max(_maxdiff(k, e, valid), _maxdiff(k, s, valid)) <= 2 * spread, (i, spread)


@pytest.mark.parametrize("bits", [4, 8])
def test_packed_cache_beam_search(bits):
    """num_beams=2 over KvattnQuantizedCache (beam reordering of the packed
    words) through Oracle: generate runs and every call is checked."""
    device = DEVICES[-1]
    m, oracle = _oracle_model("llama", device)
    ids, mask = _inputs(device, L=12, pad=3)
    cache = kt.KvattnQuantizedCache(m.config, bits=bits)
    with torch.no_grad():
        toks = m.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=5, num_beams=2,
                          do_sample=False, pad_token_id=0)
    assert toks.shape == (2, 17) and len(oracle.calls) == 5 * m.config.num_hidden_layers


def test_sliding_mask_probe():
    mu = importlib.import_module("transformers.masking_utils")
    assert kt._sliding_causal(mu.sliding_window_causal_mask_function(8), 8)
    assert not kt._sliding_causal(mu.sliding_window_causal_mask_function(8), 7)
    assert not kt._sliding_causal(mu.causal_mask_function, 8)
    chunked = getattr(mu, "chunked_causal_mask_function", None)
    if chunked is not None:
        for pad in (0, 3):
            try:
                fn = chunked(8, torch.full((1,), pad))
            except TypeError:  # transformers without the left_padding argument
                fn = chunked(8)
            assert not kt._sliding_causal(fn, 8)
    bidirectional = getattr(mu, "sliding_window_bidirectional_mask_function", None)
    if bidirectional is not None:
        assert not kt._sliding_causal(bidirectional(8), 8)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", MODELS)
def test_logits_prefill_and_decode(name, device):
    """Prefill of a left-padded batch (explicit masks), then two decode steps
    over a DynamicCache (mask None: kvattn's causal mask + the window) and an
    unpadded prefill (mask None, L = N)."""
    ms = models(name, device)
    ids, mask = _inputs(device)
    second = "sdpa" if "sdpa" in ms else "eager64"
    ms["oracle_fn"].calls.clear()
    res = {}
    for impl in ("eager", second, "kvattn_exact", "oracle"):
        m = ms[impl]
        cache = transformers.DynamicCache(config=m.config)
        o = _logits(m, ids, mask, cache)
        steps = [o.logits]
        nxt = _next(res, impl, steps)
        mk = mask
        for _ in range(2):
            mk = torch.cat([mk, torch.ones_like(mk[:, :1])], dim=1)
            with torch.no_grad():
                o = m(input_ids=nxt, attention_mask=mk, past_key_values=cache, use_cache=True)
            steps.append(o.logits)
            nxt = _next(res, impl, steps)
        # unpadded, sequence 0 after the padding (longer than the window):
        # no mask, prefill and decode
        cache = transformers.DynamicCache(config=m.config)
        x = ids[:1]
        for _ in range(3):
            with torch.no_grad():
                lg = m(input_ids=x, past_key_values=cache, use_cache=True).logits
            steps.append(lg)
            x = _next(res, impl, steps)
        res[impl] = steps
    for i, (e, s, k) in enumerate(zip(res["eager"], res[second], res["kvattn_exact"])):
        valid = mask if i == 0 else None
        spread = _maxdiff(e, s, valid)
        d_e, d_s = _maxdiff(k, e, valid), _maxdiff(k, s, valid)
        assert max(d_e, d_s) <= _bound(spread), (name, i, d_e, d_s, spread)
        assert torch.isfinite(k if valid is None else k[valid.bool()]).all()
    n_layers = ms["eager"].config.num_hidden_layers
    calls = ms["oracle_fn"].calls
    # the decode steps over the cache and the prefills: every layer checked;
    # the unpadded prefill ran without a mask (sliding layers: kvattn's window)
    assert len(calls) == 6 * n_layers
    assert all(none for none, sliding in calls[3 * n_layers:])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", MODELS)
def test_greedy_generate(name, device):
    ms = models(name, device)
    ids, mask = _inputs(device, L=12, pad=3)
    toks = {}
    for impl in ("eager", "kvattn_exact", "oracle"):
        with torch.no_grad():
            toks[impl] = ms[impl].generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                                           pad_token_id=0)
    assert torch.equal(toks["eager"], toks["kvattn_exact"])
    assert toks["oracle"].shape == toks["eager"].shape


# ------------------------------------------------------------------ packed cache
def _eager_fn(model):
    mod = importlib.import_module(type(model).__module__)
    return mod.eager_attention_forward


def _kernel_atol(kernel, device):
    """The arithmetic allowance of the kernel that ran (test_torch_ops'
    atol_of): f32 products ("[exact f32]"), else 16-bit products (the
    query rounding of "[q int8]" included); on CUDA the 16-bit allowance."""
    if device != "cpu":
        return BF16_PRODUCTS_ATOL
    bracket = kernel[kernel.rindex("["):]
    return COMPUTE_ATOL if bracket == "[exact f32]" else BF16_PRODUCTS_ATOL


class Oracle:
    """AttentionInterface function that runs kvattn (default kernels, then
    exact=True) and, on the same query and K/V (a packed cache
    dequantized), the model's eager attention in float32 and float64; each
    call asserts both kvattn outputs within max(SPREAD_FACTOR *
    |eager32 - eager64|, the kernel's allowance) of the float64 eager
    output, and returns the default kernel's output."""

    def __init__(self, model, device):
        self.eager, self.device, self.calls = _eager_fn(model), device, []

    @staticmethod
    def _kernel(module, query, key, value, mask, window, **kwargs):
        """The kernel kvattn selects on the CPU for this call (numpy copies
        of the same operands and options)."""
        def np_(t):
            a = t.detach().cpu().contiguous().numpy()
            return a.view("uint32") if a.dtype.name == "int32" else a
        kv = [tuple(np_(t) for t in x.tuple()) if isinstance(x, kt.PackedKV) else np_(x) for x in (key, value)]
        bits = key.bits if isinstance(key, kt.PackedKV) else 4
        gs = key.group_size if isinstance(key, kt.PackedKV) else 64
        sinks = kwargs.get("s_aux")
        if sinks is None:
            sinks = getattr(module, "sinks", None)
        causal = mask is None and getattr(module, "is_causal", True)
        return kvattn.attention_kernel(np_(query), kv[0], kv[1], kwargs.get("scaling"),
                                       "causal" if causal else (None if mask is None else np_(mask)),
                                       window if causal and window else None, None, kwargs.get("softcap"),
                                       None if sinks is None else np_(sinks.float()), gs, bits)

    def _eager(self, module, q, k, v, mask, dtype, **kwargs):
        if mask is not None:
            mask = torch.where(mask, 0.0, float("-inf")).to(dtype) if mask.dtype == torch.bool else mask.to(dtype)
        sinks = getattr(module, "sinks", None)
        if sinks is not None:
            saved = sinks.data
            sinks.data = saved.to(dtype)
            if kwargs.get("s_aux") is not None:
                kwargs["s_aux"] = sinks
        try:
            o, _ = self.eager(module, q.to(dtype), k.to(dtype), v.to(dtype), mask, **kwargs)
        finally:
            if sinks is not None:
                sinks.data = saved
        return o

    def __call__(self, module, query, key, value, attention_mask, **kwargs):
        packed = isinstance(key, kt.PackedKV)
        got, _ = kt.kvattn_attention_forward(module, query, key, value, attention_mask, **kwargs)
        exact, _ = kt.kvattn_attention_forward(module, query, key, value, attention_mask, kvattn_exact=True, **kwargs)
        kd, vd = (key.dequantize(), value.dequantize()) if packed else (key, value)
        L, N = query.shape[2], kd.shape[2]
        w = kwargs.get("sliding_window") or getattr(module, "sliding_window", None)
        self.calls.append((attention_mask is None, bool(w)))
        mask = attention_mask
        if mask is None:
            if L > 1 and N > L:  # a static cache's first prefill (sdpa's rule)
                kd, vd, key, value, N = kd[:, :, :L], vd[:, :, :L], key[:, :, :L], value[:, :, :L], L
            # what transformers means by no mask: causal, rows at the end of
            # the keys, the layer's window (spelled out for eager)
            pos = torch.arange(N - L, N, device=query.device)[:, None]
            j = torch.arange(N, device=query.device)[None, :]
            mask = ((j <= pos) & ((j > pos - w) if w else True))[None, None]
        r32 = self._eager(module, query, kd, vd, mask, torch.float32, **kwargs)
        r64 = self._eager(module, query, kd, vd, mask, torch.float64, **kwargs)
        # rows that see no key (padding queries) are NaN in eager: not compared
        rows = torch.isfinite(r64).all(-1)
        spread = (r32.double() - r64).abs()[rows].max().item()
        if self.device == "cpu":
            kernel = self._kernel(module, query, key, value, attention_mask, w, **kwargs)
        else:
            kernel = "[cuda]"
        for out, atol in ((got, _kernel_atol(kernel, self.device)), (exact, COMPUTE_ATOL)):
            d = (out.double() - r64).abs()[rows].max().item()
            assert d <= max(SPREAD_FACTOR * spread, atol), (kernel, d, spread, atol)
        return got, None


def _oracle_model(name, device):
    ms = models(name, device)
    ms["oracle_fn"].calls.clear()
    return ms["oracle"], ms["oracle_fn"]


def test_dequantize_matches_kvattn():
    np = pytest.importorskip("numpy")
    g = torch.Generator().manual_seed(5)
    for bits in (4, 8):
        x = torch.randn(2, 3, 7, 128, generator=g)
        p, s, b = kvattn.quantize(x.numpy(), 64, bits)
        got = kt.dequantize(torch.from_numpy(p.view(np.int32)), torch.from_numpy(s), torch.from_numpy(b), bits, 64)
        assert np.array_equal(got.numpy(), kvattn.dequantize(p, s, b, 64, bits))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("name", MODELS)
def test_packed_cache(name, bits, device):
    """A padded prefill (explicit mask) and decode steps (no mask) over
    KvattnQuantizedCache: every attention call checked by Oracle; the
    packed words are kvattn.quantize of the layer's K/V rows bit for bit;
    the cache is smaller than the float32 cache by the packing ratio."""
    np = pytest.importorskip("numpy")
    m, oracle = _oracle_model(name, device)
    ids, mask = _inputs(device)
    cache = kt.KvattnQuantizedCache(m.config, bits=bits)
    l0 = cache.layers[0]
    seen = []
    update = l0.update
    l0.update = lambda k, v, *a, **kw: (seen.append(k.detach().clone()), update(k, v, *a, **kw))[1]
    n_layers = m.config.num_hidden_layers
    for c, (x, xm) in ((cache, (ids, mask)), (kt.KvattnQuantizedCache(m.config, bits=bits), (ids[:1], None))):
        mk, step_ids = xm, x
        oracle.calls.clear()
        for _ in range(3):
            with torch.no_grad():
                logits = m(input_ids=step_ids, attention_mask=mk, past_key_values=c, use_cache=True).logits
            assert torch.isfinite(logits[:, -1]).all()
            step_ids = logits[:, -1:].argmax(-1)
            if mk is not None:
                mk = torch.cat([mk, torch.ones_like(mk[:, :1])], dim=1)
        # padded batch: explicit masks throughout; unpadded: no mask, prefill
        # and decode (kvattn's causal mask, and its window on sliding layers)
        assert len(oracle.calls) == 3 * n_layers
        assert all(none == (xm is None) for none, sliding in oracle.calls)
    n = ids.shape[1] + 2
    assert l0.length == n and cache.get_seq_length() == n
    # layer 0's packed K: kvattn.quantize of the rows update() was given, bit for bit
    rows = torch.cat(seen, dim=2).cpu().numpy()
    want = kvattn.quantize(rows, 64, bits)
    got = [t[:, :, :n].cpu().contiguous().numpy() for t in l0.k]
    assert np.array_equal(got[0].view(np.uint32), want[0])
    assert np.array_equal(got[1], want[1]) and np.array_equal(got[2], want[2])
    float_bytes = sum(2 * ly.length * ly.dims[0] * ly.dims[1] * (ly.dims[2] + ly.dims[3]) // 2 * 4
                      for ly in cache.layers)
    packed = sum(2 * ly.length * ly.dims[0] * ly.dims[1] * (ly.dims[2] + ly.dims[3]) // 2 * bits // 8
                 + 4 * ly.length * ly.dims[0] * ly.dims[1] * (ly.dims[2] + ly.dims[3]) // 64 * 4 // 2
                 for ly in cache.layers)
    assert packed < float_bytes


@pytest.mark.parametrize("name", ["llama", "gemma2", "gemma3", "gpt_oss"])
def test_packed_cache_generate(name):
    """model.generate(past_key_values=KvattnQuantizedCache) decodes over the
    packed cache, every attention call checked by Oracle."""
    device = DEVICES[-1]
    m, oracle = _oracle_model(name, device)
    ids, mask = _inputs(device, L=12, pad=3)
    cache = kt.KvattnQuantizedCache(m.config, bits=4)
    with torch.no_grad():
        toks = m.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=6,
                          do_sample=False, pad_token_id=0)
    assert toks.shape == (2, 18)
    assert cache.get_seq_length() == ids.shape[1] + 5
    assert len(oracle.calls) == 6 * m.config.num_hidden_layers


def test_fallback_with_gradients():
    """Gradients required: the torch fallback runs (same logits) and
    backpropagates."""
    ms = models("llama", "cpu")
    ids, mask = _inputs("cpu")
    m = ms["kvattn_exact"]
    with torch.no_grad():
        want = m(input_ids=ids, attention_mask=mask).logits
    got = m(input_ids=ids, attention_mask=mask).logits
    assert _maxdiff(got.detach(), want, mask) <= F32_FLOOR
    assert kt.fallbacks and all(r.startswith("gradients") for r in kt.fallbacks)
    got[mask.bool()].sum().backward()
    assert m.model.layers[0].self_attn.q_proj.weight.grad is not None
    m.zero_grad(set_to_none=True)


def test_packed_cache_with_other_attention():
    """A packed cache under another attention function: an error naming
    attn_implementation="kvattn", not a crash."""
    ms = models("llama", "cpu")
    ids, mask = _inputs("cpu")
    with pytest.raises((TypeError, AttributeError), match="kvattn"):
        with torch.no_grad():
            ms["eager"](input_ids=ids, attention_mask=mask, past_key_values=kt.KvattnQuantizedCache(bits=4),
                        use_cache=True)


def test_cache_growth():
    """Appends past the initial capacity: the buffers grow, the words of
    every token stay kvattn.quantize of its row; beam reordering moves the
    packed rows."""
    np = pytest.importorskip("numpy")
    g = torch.Generator().manual_seed(9)
    c = kt.KvattnQuantizedCache(num_layers=1, bits=4)
    ks = [torch.randn(2, 2, n, 64, generator=g) for n in (200, 1, 99, 7)]
    for k in ks:
        pk, pv = c.update(k, -k, 0)
    rows = torch.cat(ks, dim=2)
    layer = c.layers[0]
    assert layer.capacity >= 307 and pk.shape == (2, 2, 307, 64) and c.get_seq_length() == 307
    want = kvattn.quantize(rows.numpy(), 64, 4)
    assert np.array_equal(pk.data.contiguous().numpy().view(np.uint32), want[0])
    assert np.array_equal(pk.scales.contiguous().numpy(), want[1])
    assert np.array_equal(pv.dequantize().numpy(), kvattn.dequantize(*kvattn.quantize((-rows).numpy(), 64, 4), 64, 4))
    layer.reorder_cache(torch.tensor([1, 0]))
    pk2 = layer._marker(layer.k, 64)
    assert np.array_equal(pk2.data[0].contiguous().numpy().view(np.uint32), want[0][1])
    assert np.array_equal(pk2.data[1].contiguous().numpy().view(np.uint32), want[0][0])
    layer.batch_repeat_interleave(2)  # batch [1, 1, 0, 0]
    layer.batch_select_indices(torch.tensor([0, 2]))  # batch [1, 0]
    pk3, _ = layer.update(rows[:, :, :1], rows[:, :, :1])
    assert pk3.shape == (2, 2, 308, 64)
    assert np.array_equal(pk3.data[:, :, :307].contiguous().numpy().view(np.uint32), want[0][[1, 0]])


def test_cache_errors():
    with pytest.raises(ValueError, match="bits"):
        kt.KvattnQuantizedCache(num_layers=1, bits=3)
    c = kt.KvattnQuantizedCache(num_layers=1, bits=4, max_cache_len=4)
    k = torch.randn(1, 2, 3, 64)
    c.update(k, k, 0)
    with pytest.raises(ValueError, match="max_cache_len"):
        c.update(k, k, 0)
    assert c.get_seq_length() == 3
    with pytest.raises(ValueError, match="group_size"):
        kt.KvattnQuantizedCache(num_layers=1).update(torch.randn(1, 2, 3, 48), torch.randn(1, 2, 3, 48), 0)


def test_sliding_layer_trim():
    """A sliding layer (window W) keeps the last W - 1 rows when an append
    does not fit: those rows are the packed words of the last W - 1 tokens,
    bit for bit; get_mask_sizes reports what the next update keeps and the
    absolute position of its first row; get_seq_length counts every token."""
    np = pytest.importorskip("numpy")
    g = torch.Generator().manual_seed(11)
    W = 150
    layer = kt.KvattnQuantizedLayer(bits=4, sliding_window=W)
    ks = [torch.randn(2, 2, n, 64, generator=g) for n in (200, 1, 90, 30)]
    total, rows = 0, []
    for k in ks:
        n = k.shape[2]
        if layer.is_initialized:
            kept, off = layer.get_mask_sizes(n)
        pk, _ = layer.update(k, -k)
        if rows:  # the mask sizes announced before the update describe what it returned
            assert (kept, off) == (pk.shape[2], layer.dropped)
        rows.append(k)
        total += n
        assert layer.get_seq_length() == total and layer.capacity == 2 * W
    # buffers of 2 W = 300 rows: 200, 1 and 90 fit; 30 more do not: the last W - 1 = 149 stay
    assert layer.dropped == total - (W - 1) - 30 and pk.shape[2] == W - 1 + 30
    want = kvattn.quantize(torch.cat(rows, dim=2)[:, :, layer.dropped:].numpy(), 64, 4)
    assert np.array_equal(pk.data.contiguous().numpy().view(np.uint32), want[0])
    assert np.array_equal(pk.scales.contiguous().numpy(), want[1])
    with pytest.raises(ValueError, match="sliding_window"):
        kt.KvattnQuantizedLayer(sliding_window=0)


@pytest.mark.parametrize("padded", [False, True])
def test_sliding_cache_trim_logits(padded):
    """Gemma 3 (window 8 on layer 0) over KvattnQuantizedCache past the
    sliding layer's buffer: the trimmed cache gives the logits of the same
    cache keeping every token (exact kernels: the same keys seen, f32
    summation order aside), with no mask and with a padded batch's masks
    (kv_offset); the sliding layer's buffers stay at 256 rows."""
    ms = models("gemma3", "cpu")
    m = ms["kvattn_exact"]
    ids, mask = _inputs("cpu", L=250, pad=5 if padded else 0)
    if not padded:
        mask = None
    res = []
    for trim in (True, False):
        cache = kt.KvattnQuantizedCache(m.config, bits=4, trim_sliding=trim)
        step_ids, mk, out = ids, mask, []
        for _ in range(10):
            logits = _logits(m, step_ids, mk, cache).logits
            out.append(logits[:, -1])
            step_ids = logits[:, -1:].argmax(-1) if not res else res[0][1][len(out) - 1]
            if mk is not None:
                mk = torch.cat([mk, torch.ones_like(mk[:, :1])], dim=1)
        res.append((out, [o.argmax(-1)[:, None] for o in out], cache))
    (a, _, ca), (b, _, cb) = res
    assert ca.layers[0].is_sliding and ca.layers[0].dropped > 0 and ca.layers[0].capacity == 256
    assert not ca.layers[1].is_sliding and ca.layers[1].length == 259 and cb.layers[0].length == 259
    assert ca.get_seq_length() == cb.get_seq_length() == 259
    assert ca.nbytes() < cb.nbytes()
    for x, y in zip(a, b):
        assert _maxdiff(x, y) <= F32_FLOOR
