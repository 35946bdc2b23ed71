"""kvattn as a Hugging Face transformers attention backend.

    import kvattn.integrations.transformers as kt       # registers "kvattn"
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="kvattn")
    cache = kt.KvattnQuantizedCache(model.config, bits=4)  # K/V MLX-packed
    model.generate(ids, past_key_values=cache, max_new_tokens=32)

Importing this module imports torch and transformers and registers
kvattn_attention_forward as the AttentionInterface function "kvattn", with
kvattn_mask as its mask function: transformers' sdpa mask builder, whose
mask is None where the pattern is plain causal attention (no padding; for
sliding layers too, the window then applied by the kernel), a bool
[B, 1, L, N] tensor otherwise.

kvattn_attention_forward(module, query [B, H, L, D], key, value
[B, KVH, N, D], attention_mask, dropout, scaling, is_causal, **kwargs) ->
(out [B, L, H, Dv], None) runs one kvattn call through the compiled torch
operators (kvattn.torch_ops): GQA natively (no repeat_kv), scaling, softcap
(kwargs "softcap", else module.attn_logit_softcapping, else the config's),
sinks (kwargs "s_aux" or module.sinks: per-head logits in the softmax
denominator, gpt-oss), the layer's sliding window (kwargs "sliding_window"
or module.sliding_window). Mask: None -> kvattn's causal mask with the query
rows at the end of the keys (prefill, chunked prefill, decode) plus the
window, or no mask for a non-causal module; a tensor (padding, packed
sequences, images, any pattern transformers built) -> passed to the kernel
as an explicit mask (bool: True = visible, or additive float), without
kvattn's causal mask or window (the tensor already holds them). key/value
may be PackedKV markers from KvattnQuantizedCache: the kernel then reads
the MLX-packed cache in place.

Falls back to a float32 torch implementation of the same attention (and
says why, once per reason, through transformers' logger) when the kernel
cannot serve the call: gradients required, dropout in training, a
position_bias, a dtype other than float32/float16/bfloat16, the torch
extension not loaded, or a kvattn error (e.g. an unsupported head dim).
The fallback dequantizes a packed cache; the kernel path never does.
"""
import collections
import functools
import math

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.utils import logging

from .. import torch_ops
from .._capi import KvaError

__all__ = ["KvattnQuantizedCache", "KvattnQuantizedLayer", "PackedKV", "dequantize", "fallbacks",
           "kvattn_attention_forward", "kvattn_mask", "register"]

logger = logging.get_logger(__name__)

_FLOAT = (torch.float32, torch.float16, torch.bfloat16)

# reason -> number of calls that took the torch fallback (tests check it)
fallbacks = collections.Counter()


# ------------------------------------------------------------------ packed cache
class PackedKV:
    """What KvattnQuantizedCache.update returns in place of a key or value
    tensor: the layer's MLX-packed K or V of the first `length` tokens,
    views into the preallocated buffers (data int32 [B, KVH, N, D*bits/32],
    scales / biases [B, KVH, N, D/group_size]). `shape` is the logical
    [B, KVH, N, D] of the dequantized tensor."""

    __slots__ = ("data", "scales", "biases", "bits", "group_size", "head_dim", "length")

    def __init__(self, data, scales, biases, bits, group_size, head_dim, length):
        self.data, self.scales, self.biases = data, scales, biases
        self.bits, self.group_size, self.head_dim, self.length = bits, group_size, head_dim, length

    @property
    def shape(self):
        return torch.Size((self.data.shape[0], self.data.shape[1], self.length, self.head_dim))

    @property
    def dtype(self):
        return self.scales.dtype

    @property
    def device(self):
        return self.data.device

    def tuple(self):
        return self.data, self.scales, self.biases

    def dequantize(self):
        """The float [B, KVH, N, D] tensor (scales' dtype); the fallback and
        tests use it, the kernel path never does."""
        return dequantize(self.data, self.scales, self.biases, self.bits, self.group_size)

    def __getattr__(self, name):
        # a tensor method or attribute asked by another attention function
        raise AttributeError("PackedKV (KvattnQuantizedCache's packed K/V) has no %r: the cache is read only by "
                             "attn_implementation=\"kvattn\"" % name)

    def __getitem__(self, index):
        raise TypeError("PackedKV (KvattnQuantizedCache's packed K/V) cannot be indexed: the cache is read only "
                        "by attn_implementation=\"kvattn\"")

    def __repr__(self):
        return "PackedKV(shape=%s, bits=%d, group_size=%d, dtype=%s, device=%s)" % (
            list(self.shape), self.bits, self.group_size, self.dtype, self.device)


def dequantize(data, scales, biases, bits, group_size):
    """MLX affine dequantization in torch: element i of a 32-bit word is bits
    [i*bits, (i+1)*bits) (least significant first); w = scale * q + bias per
    group of group_size elements along the last axis. Returns scales' dtype."""
    per = 32 // bits
    shifts = torch.arange(per, device=data.device, dtype=torch.int32) * bits
    q = (data.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    q = q.reshape(*data.shape[:-1], data.shape[-1] * per).to(torch.float32)
    d = q.shape[-1]
    g = q.reshape(*q.shape[:-1], d // group_size, group_size)
    w = g * scales.to(torch.float32).unsqueeze(-1) + biases.to(torch.float32).unsqueeze(-1)
    return w.reshape(q.shape).to(scales.dtype)


class KvattnQuantizedLayer(CacheLayerMixin):
    """One layer's K/V, quantized on append into MLX's affine format
    (torch.ops.kvattn.cache_write_quantized: rows quantized on the tensors'
    device, bit for bit kvattn.quantize) in contiguous per-layer buffers
    [B, KVH, capacity, ...] read by the kernel as they are. The capacity is
    max_cache_len when given (preallocated, an append past it raises
    ValueError; a sliding layer's buffers at most that), else it grows by
    doubling (a copy of the packed words, not a
    dequantization). A full-attention layer keeps all its tokens. A sliding
    layer (sliding_window W) keeps what its window can still see: when an
    append would not fit, the last W - 1 rows move to the front of the
    buffers (a copy of W - 1 packed rows) and the older ones are dropped, so
    its buffers stay near max(256, 2 W) rows however long the sequence
    grows; get_mask_sizes reports the rows kept and the absolute position
    of the first (kv_offset), get_seq_length every token seen. The window
    itself is applied by the kernel (or by the mask transformers builds)."""

    is_compileable = False
    is_croppable = False

    def __init__(self, bits=4, group_size=64, max_cache_len=None, sliding_window=None, **kwargs):
        super().__init__()
        if bits not in (4, 8):
            raise ValueError("bits = %r: KvattnQuantizedCache stores 4 or 8 bits" % (bits,))
        if group_size not in (32, 64, 128):
            raise ValueError("group_size = %r must be 32, 64 or 128" % (group_size,))
        if max_cache_len is not None and (not isinstance(max_cache_len, int) or max_cache_len <= 0):
            raise ValueError("max_cache_len = %r must be a positive int or None" % (max_cache_len,))
        if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window <= 0):
            raise ValueError("sliding_window = %r must be a positive int or None" % (sliding_window,))
        self.bits, self.group_size, self.max_cache_len = bits, group_size, max_cache_len
        self.window = sliding_window
        self.is_sliding = sliding_window is not None
        self.dropped = 0  # tokens before the first row kept (sliding layers)
        self.length = 0  # rows kept
        self.capacity = 0
        self.k = self.v = None  # [data, scales, biases]
        self._base = None  # slot of each sequence's first row (cleared when the capacity or batch changes)

    def _alloc(self, B, KVH, cap, d, dtype, device):
        return [torch.zeros(B, KVH, cap, d * self.bits // 32, dtype=torch.int32, device=device),
                torch.zeros(B, KVH, cap, d // self.group_size, dtype=dtype, device=device),
                torch.zeros(B, KVH, cap, d // self.group_size, dtype=dtype, device=device)]

    def lazy_initialization(self, key_states, value_states):
        B, KVH, L, dk = key_states.shape
        dv = value_states.shape[-1]
        for name, d in (("key", dk), ("value", dv)):
            if d % self.group_size:
                raise ValueError("%s head dim %d is not a multiple of group_size %d" % (name, d, self.group_size))
        if key_states.dtype not in _FLOAT:
            raise ValueError("key_states dtype %s: float32, float16 or bfloat16 expected" % key_states.dtype)
        self.device, self.dtype = key_states.device, key_states.dtype
        self.dims = (B, KVH, dk, dv)
        cap = max(256, 1 << (L - 1).bit_length())
        if self.window is not None:
            cap = max(cap, 2 * self.window)
        if self.max_cache_len is not None:
            cap = self.max_cache_len if self.window is None else min(cap, self.max_cache_len)
        self.k = self._alloc(B, KVH, cap, dk, self.dtype, self.device)
        self.v = self._alloc(B, KVH, cap, dv, self.dtype, self.device)
        self.capacity = cap
        self.length = 0
        self.dropped = 0
        self._base = None
        self.is_initialized = True

    def _keep_from(self, L):
        """The first row an append of L tokens keeps: a sliding layer whose
        buffers cannot take the L rows drops all but the last W - 1."""
        if self.window is not None and self.length + L > self.capacity and self.length > self.window - 1:
            return self.length - (self.window - 1)
        return 0

    def _trim(self, first):
        """Moves rows [first, length) to the front of every buffer."""
        n = self.length - first
        for bufs in (self.k, self.v):
            for t in bufs:
                t[:, :, :n] = t[:, :, first:self.length].clone()
        self.dropped += first
        self.length = n

    def _grow(self, need):
        if self.max_cache_len is not None and (self.window is None or need > self.max_cache_len):
            raise ValueError("KvattnQuantizedCache: %d tokens do not fit max_cache_len = %d"
                             % (need, self.max_cache_len))
        cap = max(need, 2 * self.capacity)
        if self.max_cache_len is not None:
            cap = min(cap, self.max_cache_len)
        B, KVH, dk, dv = self.dims
        for old, d in ((self.k, dk), (self.v, dv)):
            new = self._alloc(B, KVH, cap, d, self.dtype, self.device)
            for o, n in zip(old, new):
                n[:, :, :self.length].copy_(o[:, :, :self.length])
            old[:] = new
        self.capacity = cap
        self._base = None

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        B, KVH, L, dk = key_states.shape
        if (B, KVH, dk, value_states.shape[-1]) != self.dims or value_states.shape[:3] != key_states.shape[:3]:
            raise ValueError("KvattnQuantizedCache: key/value states %s / %s do not match the cache's "
                             "[B, KVH, D] = %s" % (list(key_states.shape), list(value_states.shape), self.dims))
        first = self._keep_from(L)
        if first:
            self._trim(first)
        if self.length + L > self.capacity:
            self._grow(self.length + L)
        # rows [B*L, KVH, D] at slots b * capacity + position (the buffers as a
        # block pool of B blocks of `capacity` rows)
        k = key_states.to(self.dtype).transpose(1, 2).reshape(B * L, KVH, dk)
        v = value_states.to(self.dtype).transpose(1, 2).reshape(B * L, KVH, -1)
        if self._base is None or self._base.shape[0] != B:  # b * capacity, [B, 1] int32
            self._base = torch.arange(B, device=self.device, dtype=torch.int32)[:, None] * self.capacity
        slots = self._base + torch.arange(self.length, self.length + L, device=self.device, dtype=torch.int32)
        torch_ops.load().cache_write_quantized(*self.k, *self.v, k, v, slots.reshape(-1), bits=self.bits,
                                               group_size=self.group_size)
        self.length += L
        return self._marker(self.k, dk), self._marker(self.v, self.dims[3])

    def _marker(self, bufs, d):
        n = self.length
        return PackedKV(bufs[0][:, :, :n], bufs[1][:, :, :n], bufs[2][:, :, :n], self.bits, self.group_size, d, n)

    def get_mask_sizes(self, query_length):
        if isinstance(query_length, torch.Tensor):  # older transformers pass cache_position
            query_length = query_length.shape[0]
        first = self._keep_from(query_length) if self.is_initialized else 0
        return self.length - first + query_length, self.dropped + first

    def get_seq_length(self):
        return self.dropped + self.length

    def get_max_length(self):
        return -1 if self.max_cache_len is None else self.max_cache_len

    def get_max_cache_shape(self):
        return self.get_max_length()

    def reset(self):
        self.length = 0
        self.dropped = 0

    def offload(self):
        raise NotImplementedError("KvattnQuantizedCache does not offload")

    def prefetch(self):
        pass

    def _select(self, fn):
        if self.is_initialized:
            for bufs in (self.k, self.v):
                bufs[:] = [fn(t).contiguous() for t in bufs]
            self.dims = (self.k[0].shape[0],) + self.dims[1:]
            self._base = None

    def reorder_cache(self, beam_idx):
        self._select(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats):
        self._select(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices):
        self._select(lambda t: t[indices])


def _sliding_windows(text, num_layers):
    """Each layer's sliding window (None: full attention) as transformers
    builds its caches: layer_types "sliding_attention" take the config's
    sliding_window; without layer_types every layer does when it is set."""
    w = getattr(text, "sliding_window", None)
    w = int(w) if w else None
    types = getattr(text, "layer_types", None)
    if w is None:
        return [None] * num_layers
    if types is None:
        return [w] * num_layers
    return [w if t == "sliding_attention" else None for t in list(types)[:num_layers]]


class KvattnQuantizedCache(Cache):
    """A transformers Cache whose layers keep K/V MLX-packed (bits 4 or 8,
    group_size 32/64/128, scales and biases in the model's dtype) on the
    model's device. update() quantizes the new rows on append and returns
    PackedKV markers, which the "kvattn" attention function reads in place:
    the whole cache is never dequantized. Use with
    attn_implementation="kvattn".

    config: the model's config (one layer per num_hidden_layers) or None
    (layers created as update() reaches them). max_cache_len: preallocate
    that many tokens per layer (else the buffers grow by doubling).
    trim_sliding: the config's sliding-window layers (layer_types
    "sliding_attention", or every layer when the config has a
    sliding_window and no layer_types, as transformers reads it) keep only
    the rows their window can still see (KvattnQuantizedLayer); False keeps
    every token in every layer."""

    def __init__(self, config=None, bits=4, group_size=64, max_cache_len=None, num_layers=None, trim_sliding=True):
        make = functools.partial(KvattnQuantizedLayer, bits=bits, group_size=group_size,
                                 max_cache_len=max_cache_len)
        windows = []
        if config is not None:
            text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
            if num_layers is None:
                num_layers = text.num_hidden_layers
            windows = _sliding_windows(text, num_layers) if trim_sliding else []
        if num_layers is not None:
            windows = windows or [None] * num_layers
            super().__init__(layers=[make(sliding_window=w) for w in windows])
        else:
            super().__init__(layer_class_to_replicate=make)
        self.bits, self.group_size = bits, group_size

    def nbytes(self):
        """Bytes held by the packed buffers (data, scales and biases, K and V)."""
        return sum(t.numel() * t.element_size() for layer in self.layers if layer.is_initialized
                   for bufs in (layer.k, layer.v) for t in bufs)


# ------------------------------------------------------------------ attention
def _warn(reason):
    fallbacks[reason] += 1
    logger.warning_once("kvattn attention: falling back to the torch implementation: " + reason)


def _module_attr(module, name):
    v = getattr(module, name, None)
    if v is None:
        cfg = getattr(module, "config", None)
        v = getattr(cfg, name, None) if cfg is not None else None
    return v


def _math_attention(q, k, v, mask, scale, softcap, sinks, causal, window):
    """The same attention in float32 torch ops (the fallback): q [B, H, L, D],
    k/v [B, KVH, N, D] float, causal rows at the end of the keys; a row that
    sees no key gives zeros (kvattn's convention)."""
    B, H, L, _ = q.shape
    KVH, N = k.shape[1], k.shape[2]
    k = k.float().repeat_interleave(H // KVH, dim=1)
    v = v.float().repeat_interleave(H // KVH, dim=1)
    s = torch.matmul(q.float(), k.transpose(-1, -2)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.float()
    elif causal:
        pos = torch.arange(N - L, N, device=q.device)[:, None]
        j = torch.arange(N, device=q.device)[None, :]
        vis = j <= pos
        if window:
            vis = vis & (j > pos - window)
        s = s.masked_fill(~vis, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.float().reshape(1, H, 1, 1).expand(B, H, L, 1)], dim=-1)
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m)
    den = p.sum(-1, keepdim=True)
    p = torch.where(den > 0, p / den, torch.zeros_like(p))
    if sinks is not None:
        p = p[..., :N]
    return torch.matmul(p, v).to(q.dtype)


def kvattn_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                             *, kvattn_exact=False, **kwargs):
    """transformers AttentionInterface function "kvattn" (see the module
    documentation). Returns (attn_output [B, L, H, Dv] contiguous, None).
    kvattn_exact: run only "[exact f32]" kernels (validation; see
    kvattn.attention's exact)."""
    if kwargs.get("output_attentions", False):
        logger.warning_once("kvattn attention does not return attention weights (output_attentions=True)")
    packed = isinstance(key, PackedKV)
    if packed != isinstance(value, PackedKV):
        raise ValueError("kvattn attention: key and value must both be tensors or both PackedKV")
    B, H, L, dk = query.shape
    N = key.shape[2]
    dv = value.shape[-1]
    scale = 1.0 / math.sqrt(dk) if scaling is None else float(scaling)
    softcap = kwargs.get("softcap")
    if softcap is None:
        softcap = _module_attr(module, "attn_logit_softcapping")
    softcap = float(softcap) if softcap else None
    sinks = kwargs.get("s_aux")
    if sinks is None:
        sinks = getattr(module, "sinks", None)
    window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
    window = int(window) if window else None
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    mask = attention_mask
    if mask is None and causal and not packed and L > 1 and N > L:
        # transformers leaves the mask out here only for a prefill into an
        # empty static cache: the keys past the first L are not written yet
        key, value, N = key[:, :, :L], value[:, :, :L], L
    if mask is not None and mask.dtype != torch.bool and mask.dtype != torch.float32:
        mask = mask.float()

    reason = None
    if torch.is_grad_enabled() and (query.requires_grad or (not packed and (key.requires_grad or value.requires_grad))
                                    or (sinks is not None and sinks.requires_grad)):
        reason = "gradients required (the kvattn operators have no backward)"
    elif dropout and getattr(module, "training", False):
        reason = "dropout %g in training" % dropout
    elif kwargs.get("position_bias") is not None:
        reason = "position_bias"
    elif query.dtype not in _FLOAT or (not packed and (key.dtype not in _FLOAT or value.dtype not in _FLOAT)):
        reason = "dtype %s" % query.dtype
    elif not torch_ops.available():
        reason = torch_ops.load_error()

    if reason is None:
        sk = None if sinks is None else sinks.detach().to(device=query.device, dtype=torch.float32).contiguous()
        out = query.new_empty(B, L, H, dv)
        try:
            kv = (key.tuple(), value.tuple(), key.bits, key.group_size) if packed else (key, value, 0, 64)
            use_causal = mask is None and causal
            res = torch_ops.attention(query, kv[0], kv[1], scale, "causal" if use_causal else mask,
                                      window if use_causal else None, None, softcap, sk, kv[3], kv[2],
                                      out=out.transpose(1, 2), exact=bool(kvattn_exact))
            if res is NotImplemented:
                raise ValueError("the torch operators refused the arguments")
            return out, None
        except (ValueError, KvaError) as e:
            reason = "kvattn: %s" % e
    _warn(reason)
    kf = key.dequantize() if packed else key
    vf = value.dequantize() if packed else value
    o = _math_attention(query, kf, vf, mask, scale, softcap, sinks, mask is None and causal, window)
    return o.transpose(1, 2).contiguous(), None


def _sliding_causal(mask_function, window):
    """Whether mask_function(b, h, q, kv) is causal attention limited to
    `window` keys (kv <= q and kv > q - window), probed on rows 0, 1,
    window, window + 1 over the keys each row could see: a chunked mask of
    chunk `window` differs from it on one of the two consecutive rows, a
    plain causal one on row window + 1."""
    if mask_function is None or not isinstance(window, int) or window <= 0:
        return False
    try:
        for q in (0, 1, window, window + 1):
            kv = torch.arange(max(0, q - window - 1), q + 2)
            got = mask_function(torch.tensor(0), torch.tensor(0), torch.tensor(q), kv)
            want = (kv <= q) & (kv > q - window)
            if not torch.equal(torch.as_tensor(got, dtype=torch.bool).expand(want.shape), want):
                return False
    except Exception:  # a mask function that cannot be probed this way: keep its mask
        return False
    return True


def kvattn_mask(*args, **kwargs):
    """The "kvattn" mask function: transformers' sdpa mask (None where the
    pattern is plain causal attention over unpadded keys), also None for a
    sliding-window causal pattern (checked by probing the mask function)
    where it would be None without the window: kvattn_attention_forward
    then applies the layer's window itself (kwargs "sliding_window" or
    module.sliding_window), so sliding layers decode without a mask tensor."""
    local = kwargs.get("local_size")
    if local is not None and kwargs.get("allow_is_causal_skip", True) and \
            _sliding_causal(kwargs.get("mask_function"), local):
        kwargs = dict(kwargs, local_size=None)
    return sdpa_mask(*args, **kwargs)


def register(name="kvattn", exact=False):
    """Registers kvattn_attention_forward as AttentionInterface `name` and
    kvattn_mask as its mask function (done on import for "kvattn");
    exact=True registers the "[exact f32]" kernels only."""
    fn = functools.partial(kvattn_attention_forward, kvattn_exact=True) if exact else kvattn_attention_forward
    AttentionInterface.register(name, fn)
    AttentionMaskInterface.register(name, kvattn_mask)


register()
