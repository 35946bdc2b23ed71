/* torch.ops.kvattn.*: the library's attention, cache write and state merge
 * as PyTorch operators (TORCH_LIBRARY), so that tensors become kvattn
 * descriptors in compiled code. Each call builds kva_tensor / kva_kv /
 * kva_attn_params on the stack from the tensors' pointers, shapes and byte
 * strides (no copy), checks what the library cannot see (devices, the
 * lengths of pointer-only arrays), and calls libkvattn on the tensors'
 * backend: a CPU context for CPU tensors, a CUDA context per (device,
 * current stream) for CUDA tensors. Functional ops allocate their outputs;
 * the *_out ops write caller tensors and allocate nothing (CUDA: besides a
 * one-time workspace per (device, stream), or a workspace from the graph's
 * pool while the stream is being captured). Meta kernels give the output
 * shapes, so torch.compile traces the ops without a graph break.
 *
 * Errors: a c10::ValueError (Python ValueError) carrying kva_last_error(),
 * or the binding's own message for device, dtype and shape checks; nothing
 * is written on error. */
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <pthread.h>

#include <algorithm>
#include <string>
#include <type_traits>
#include <vector>

#include "kvattn.h"

#ifdef KVATTN_TORCH_PYTHON
#include <Python.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/autograd/python_variable.h>
#endif

#ifdef KVATTN_TORCH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#endif

namespace {

using at::Tensor;
using OptTensor = std::optional<at::Tensor>;

constexpr int kWordBits = 32;

[[noreturn]] void fail(const std::string &msg) { TORCH_CHECK_VALUE(false, msg); }

void check(int rc) {
  if (rc < 0) {
    const char *m = kva_last_error();
    fail(m && *m ? std::string(m) : std::string(kva_strerror(rc)));
  }
}

std::string binding_error(int status, const std::string &what) {
  return std::string(kva_strerror(status)) + ": " + what;
}

int int32_arg(int64_t x, const char *name) {
  if (x < INT32_MIN || x > INT32_MAX) fail(binding_error(KVA_EINVAL, std::string(name) + " = " + std::to_string(x) +
                                                                         " is out of the int32 range"));
  return (int)x;
}

int kva_dtype_of(at::ScalarType s) {
  switch (s) {
  case at::kFloat: return KVA_F32;
  case at::kHalf: return KVA_F16;
  case at::kBFloat16: return KVA_BF16;
  case at::kInt: return KVA_I32;
  case at::kUInt32: return KVA_U32;
  case at::kBool: return KVA_BOOL;
  default: return -1;
  }
}

bool is_float(at::ScalarType s) { return s == at::kFloat || s == at::kHalf || s == at::kBFloat16; }

/* Every tensor of a call lives on q's device: the library cannot tell a host
 * pointer from a device pointer. */
void same_device(const Tensor &t, const at::Device &dev, const char *name) {
  if (t.device() == dev) return;
  std::string what = std::string(name) + " is on " + t.device().str() + ", the call on " + dev.str();
  if (t.is_cpu() && dev.is_cuda()) what += " (a CPU tensor in a CUDA call)";
  fail(binding_error(KVA_EINVAL, what + ": every tensor of one call must be on one device"));
}

/* kva_tensor of t in place: byte strides; a dim of size 1 gets a harmless
 * non-negative stride (the innermost one the element size), as the library
 * requires. packed: int32 words are read as the library's u32. */
kva_tensor desc(const Tensor &t, const char *name, bool packed = false) {
  int dt = kva_dtype_of(t.scalar_type());
  if (dt < 0) fail(binding_error(KVA_EDTYPE, std::string(name) + " has unsupported dtype " +
                                                 std::string(c10::toString(t.scalar_type()))));
  if (packed && dt == KVA_I32) dt = KVA_U32;
  const int64_t nd = t.dim();
  if (nd > KVA_MAX_DIMS)
    fail(binding_error(KVA_ESHAPE, std::string(name) + " has rank " + std::to_string(nd) + " (at most 4)"));
  kva_tensor d{};
  d.data = t.data_ptr();
  d.dtype = (kva_dtype)dt;
  d.ndim = (int)nd;
  const int64_t es = (int64_t)t.element_size();
  for (int64_t i = 0; i < nd; ++i) {
    const int64_t n = t.size(i), s = t.stride(i) * es;
    d.shape[i] = n;
    d.stride[i] = n == 1 ? (i == nd - 1 ? es : std::max<int64_t>(s, 0)) : s;
  }
  return d;
}

/* An int32 / float32 array the library reads through a bare pointer
 * ([n] elements): its length, dtype and contiguity are checked here. */
const void *vector_arg(const Tensor &t, const char *name, at::ScalarType st, int64_t n, const at::Device &dev) {
  same_device(t, dev, name);
  if (t.scalar_type() != st)
    fail(binding_error(KVA_EDTYPE, std::string(name) + " has dtype " + std::string(c10::toString(t.scalar_type())) +
                                       " (" + std::string(c10::toString(st)) + " expected)"));
  if (t.dim() != 1 || t.size(0) != n)
    fail(binding_error(KVA_ESHAPE, std::string(name) + " must have shape [" + std::to_string(n) + "], got " +
                                       c10::str(t.sizes())));
  if (n > 1 && t.stride(0) != 1)
    fail(binding_error(KVA_ESTRIDE, std::string(name) + " must be contiguous (stride " +
                                        std::to_string(t.stride(0)) + " elements)"));
  return t.data_ptr();
}

/* One K or V operand (or pool): float data, or MLX-packed words + scales + biases. */
struct KvNames {
  const char *data, *scales, *biases;
};
kva_kv kv_of(const Tensor &data, const OptTensor &scales, const OptTensor &biases, int bits, int group_size,
             const KvNames &nm, const at::Device &dev) {
  same_device(data, dev, nm.data);
  kva_kv kv{};
  if (bits == 0) {
    if (scales.has_value() || biases.has_value())
      fail(binding_error(KVA_EINVAL, std::string(nm.scales) + " / " + nm.biases + " given with bits = 0 (a float " +
                                         nm.data + ")"));
    kv.data = desc(data, nm.data);
    return kv;
  }
  if (!scales.has_value() || !biases.has_value())
    fail(binding_error(KVA_EINVAL, std::string(nm.data) + " is packed (bits = " + std::to_string(bits) + "): " +
                                       nm.scales + " and " + nm.biases + " are required"));
  same_device(*scales, dev, nm.scales);
  same_device(*biases, dev, nm.biases);
  kv.data = desc(data, nm.data, true);
  kv.scales = desc(*scales, nm.scales);
  kv.biases = desc(*biases, nm.biases);
  kv.bits = bits;
  kv.group_size = group_size;
  return kv;
}

/* ------------------------------------------------------------ contexts */
/* CPU tensors share one all-cores CPU context (kept across fork(), as the
 * library allows). CUDA tensors use one context per (device, stream): its
 * stream is set once and never switched, so the context's state is used in
 * that stream's order. A per-context mutex covers the workspace. Contexts
 * live until exit (never destroyed: CUDA teardown order at exit). In a
 * forked child the CUDA contexts are dropped (the CUDA runtime does not
 * survive a fork) and every lock starts fresh. */
struct CudaSlot {
  int device;
  void *stream;
  kva_context *ctx;
  pthread_mutex_t mu;
  Tensor ws; /* [ws_bytes] bytes on the device, from torch's caching allocator, on `stream` */
  size_t ws_bytes;
};

pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
kva_context *g_cpu = nullptr;
std::vector<CudaSlot *> *g_slots = new std::vector<CudaSlot *>();

struct Lock {
  pthread_mutex_t *m;
  explicit Lock(pthread_mutex_t *mu) : m(mu) { pthread_mutex_lock(m); }
  ~Lock() { pthread_mutex_unlock(m); }
};

void atfork_prepare() { pthread_mutex_lock(&g_mu); }
void atfork_parent() { pthread_mutex_unlock(&g_mu); }
void atfork_child() {
  g_slots = new std::vector<CudaSlot *>(); /* the parent's CUDA contexts are unusable here: left, not freed */
  pthread_mutex_init(&g_mu, nullptr);
}
const int g_atfork = pthread_atfork(atfork_prepare, atfork_parent, atfork_child);

kva_context *cpu_context() {
  Lock l(&g_mu);
  if (!g_cpu) {
    kva_context_opts o{};
    o.backend = KVA_BACKEND_CPU;
    check(kva_context_create(&g_cpu, &o));
  }
  return g_cpu;
}

#ifdef KVATTN_TORCH_CUDA
CudaSlot *cuda_slot(int device, void *stream) {
  Lock l(&g_mu);
  for (CudaSlot *s : *g_slots)
    if (s->device == device && s->stream == stream) return s;
  kva_context_opts o{};
  o.backend = KVA_BACKEND_CUDA;
  o.device = device;
  o.stream = stream;
  kva_context *ctx = nullptr;
  check(kva_context_create(&ctx, &o));
  CudaSlot *s = new CudaSlot{device, stream, ctx, PTHREAD_MUTEX_INITIALIZER, Tensor(), 0};
  g_slots->push_back(s);
  return s;
}
#endif

#ifdef KVATTN_TORCH_CUDA
/* The eager CUDA call with the slot's workspace (slot mutex held). */
template <class Call, class Size>
void run_sized(CudaSlot *s, int index, const at::Device &dev, Call &call, Size &size) {
  if (s->ws_bytes) {
    const int rc = call(s->ctx, s->ws.data_ptr(), s->ws_bytes);
    if (rc != KVA_EWORKSPACE) {
      check(rc);
      return;
    }
  }
  size_t need = 0;
  check(size(s->ctx, &need));
  if (need > s->ws_bytes) {
    const size_t grown = std::max(need, 2 * s->ws_bytes);
    s->ws = at::empty({(int64_t)grown}, at::TensorOptions().dtype(at::kByte).device(dev.type(), index));
    s->ws_bytes = grown;
  }
  check(call(s->ctx, s->ws_bytes ? s->ws.data_ptr() : nullptr, s->ws_bytes));
}
#endif

/* Runs call(ctx, workspace, bytes) on the context of dev (and, on CUDA, of
 * the current stream). size(ctx, &bytes) reports the workspace a call needs
 * (nullptr: the call needs none). CUDA workspace: the slot's cached buffer,
 * grown when a call reports KVA_EWORKSPACE; while the stream is being
 * captured, a buffer from torch's allocator for this call only (it belongs
 * to the graph's pool, so the graph never points into the slot's buffer,
 * which a later growth may free). */
template <class Call, class Size>
void run(const at::Device &dev, Call call, Size size) {
  (void)size;
  if (dev.is_cpu()) {
    check(call(cpu_context(), nullptr, 0));
    return;
  }
#ifdef KVATTN_TORCH_CUDA
  if (dev.is_cuda()) {
    const int index = dev.index() < 0 ? (int)c10::cuda::current_device() : (int)dev.index();
    c10::cuda::CUDAGuard guard((c10::DeviceIndex)index);
    cudaStream_t stream = c10::cuda::getCurrentCUDAStream((c10::DeviceIndex)index).stream();
    CudaSlot *s = cuda_slot(index, (void *)stream);
    cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(stream, &cs) != cudaSuccess) {
      (void)cudaGetLastError();
      fail(binding_error(KVA_ECUDA, "cudaStreamIsCapturing failed on the current stream"));
    }
    constexpr bool sized = !std::is_same_v<Size, std::nullptr_t>;
    if (cs != cudaStreamCaptureStatusNone) {
      size_t need = 0;
      if constexpr (sized) check(size(s->ctx, &need));
      Tensor ws;
      if (need) ws = at::empty({(int64_t)need}, at::TensorOptions().dtype(at::kByte).device(dev.type(), index));
      check(call(s->ctx, need ? ws.data_ptr() : nullptr, need));
      return;
    }
    Lock l(&s->mu);
    if constexpr (!sized) {
      check(call(s->ctx, nullptr, 0));
      return;
    } else {
      run_sized(s, index, dev, call, size);
    }
    return;
  }
#endif
  fail(binding_error(KVA_ENODEVICE, "tensors on " + dev.str() +
                                        ": the kvattn torch extension runs CPU tensors" +
#ifdef KVATTN_TORCH_CUDA
                                        " and CUDA tensors"
#else
                                        " only (built without CUDA)"
#endif
                     ));
}

/* ------------------------------------------------------------- attention */
/* The options every attention op takes after its K/V arguments, the most
 * used first: the dispatcher's parsing costs per argument passed, so a
 * positional bf16 causal call passes five (out, q, k, v, causal). */
#define KVA_OPT_PARAMS                                                                                          \
  bool causal, const OptTensor &k_scales, const OptTensor &k_biases, const OptTensor &v_scales,                \
      const OptTensor &v_biases, int64_t bits, int64_t group_size, int64_t window, std::optional<double> scale, \
      std::optional<double> softcap, const OptTensor &sinks, const OptTensor &segments, bool clamp,            \
      const OptTensor &mask, bool exact
#define KVA_OPT_ARGS                                                                                            \
  causal, k_scales, k_biases, v_scales, v_biases, bits, group_size, window, scale, softcap, sinks, segments,  \
      clamp, mask, exact
#define KVA_OPT_SCHEMA                                                                                          \
  "bool causal=False, Tensor? k_scales=None, Tensor? k_biases=None, Tensor? v_scales=None, "                   \
  "Tensor? v_biases=None, int bits=0, int group_size=64, int window=0, float? scale=None, "                   \
  "float? softcap=None, Tensor? sinks=None, Tensor? segments=None, bool clamp=False, Tensor? mask=None, "      \
  "bool exact=False"

/* A block table (KVA_LAYOUT_BLOCK_TABLE) or none (contiguous K/V). */
struct TableArgs {
  const Tensor *blocks, *seq_lens;
  const OptTensor *first_offset;
};

/* The descriptors of one attention call; the tensors they point into stay
 * alive in the caller's frame (mask_view: the mask array broadcast by strides). */
struct AttnCall {
  kva_tensor q;
  kva_kv k, v;
  kva_block_table table;
  kva_kv_view view;
  kva_attn_params params;
  Tensor mask_view;
};

void build_call(AttnCall &c, const Tensor &q, const Tensor &k, const Tensor &v, const OptTensor &seq_lens,
                const TableArgs *tab, KVA_OPT_PARAMS) {
  const at::Device dev = q.device();
  const int b = int32_arg(bits, "bits"), g = int32_arg(group_size, "group_size");
  c.q = desc(q, "q");
  const bool tabled = tab != nullptr;
  c.k = kv_of(k, k_scales, k_biases, b, g, tabled ? KvNames{"k_pool.data", "k_pool.scales", "k_pool.biases"}
                                                  : KvNames{"k.data", "k.scales", "k.biases"}, dev);
  c.v = kv_of(v, v_scales, v_biases, b, g, tabled ? KvNames{"v_pool.data", "v_pool.scales", "v_pool.biases"}
                                                  : KvNames{"v.data", "v.scales", "v.biases"}, dev);
  const int64_t B = q.dim() == 4 ? q.size(0) : 1, H = q.dim() == 4 ? q.size(1) : 1, L = q.dim() == 4 ? q.size(2) : 1;
  int64_t N = k.dim() == 4 ? k.size(2) : 0;
  if (!tabled) {
    c.view = kva_view_contiguous(&c.k, &c.v, nullptr);
    if (seq_lens.has_value())
      c.view.seq_lens =
          (const int32_t *)vector_arg(*seq_lens, "seq_lens", at::kInt, k.dim() == 4 ? k.size(0) : B, dev);
  } else {
    const Tensor &bl = *tab->blocks;
    same_device(bl, dev, "block_table");
    if (bl.scalar_type() != at::kInt || bl.dim() != 2)
      fail(binding_error(KVA_EDTYPE, "block_table must be int32 [B, max_blocks], got " +
                                         std::string(c10::toString(bl.scalar_type())) + " " + c10::str(bl.sizes())));
    const int64_t TB = bl.size(0), mb = bl.size(1);
    if (mb > 1 && bl.stride(1) != 1)
      fail(binding_error(KVA_ESTRIDE, "block_table: innermost stride " + std::to_string(bl.stride(1)) +
                                          " elements must be 1"));
    if (TB > 1 && bl.stride(0) < mb)
      fail(binding_error(KVA_ESTRIDE, "block_table: row stride " + std::to_string(bl.stride(0)) +
                                          " elements must be >= max_blocks = " + std::to_string(mb)));
    c.table = kva_block_table{};
    c.table.batch = TB;
    c.table.max_blocks = mb;
    c.table.row_stride = TB > 1 ? bl.stride(0) : 0;
    c.table.blocks = (const int32_t *)bl.data_ptr();
    c.table.seq_lens = (const int32_t *)vector_arg(*tab->seq_lens, "seq_lens", at::kInt, TB, dev);
    if (tab->first_offset->has_value())
      c.table.first_offset = (const int32_t *)vector_arg(**tab->first_offset, "first_offset", at::kInt, TB, dev);
    c.view = kva_view_block_table(&c.k, &c.v, &c.table);
    N = mb * (k.dim() == 4 ? k.size(2) : 1); /* the longest possible sequence */
  }

  kva_attn_params &p = c.params;
  p = kva_attn_defaults();
  if (scale.has_value()) {
    if (*scale == 0.0) fail(binding_error(KVA_EINVAL, "scale = 0 is not a scale (None = 1/sqrt(Dk))"));
    p.scale = (float)*scale;
  }
  if (softcap.has_value()) {
    if (*softcap == 0.0) fail(binding_error(KVA_EINVAL, "softcap = 0 must be > 0 (None = no softcap)"));
    p.softcap = (float)*softcap;
  }
  if (sinks.has_value()) p.sinks = (const float *)vector_arg(*sinks, "sinks", at::kFloat, H, dev);
  p.flags = exact ? KVA_ATTN_EXACT : 0u;
  kva_mask &m = p.mask;
  m.window = int32_arg(window, "window");
  m.segments_clamp = clamp ? 1 : 0;
  if (segments.has_value()) {
    same_device(*segments, dev, "mask.segments");
    m.segments = desc(*segments, "mask.segments");
    if (m.segments.ndim == 1) { /* [N] for B = 1 */
      m.segments.ndim = 2;
      m.segments.shape[1] = m.segments.shape[0];
      m.segments.stride[1] = m.segments.stride[0];
      m.segments.shape[0] = 1;
      m.segments.stride[0] = m.segments.shape[1] * m.segments.stride[1];
    }
  }
  /* an int32 / uint32 mask is a tree's packed bits (KVA_MASK_TREE: [B, L, W], or [L, W] for one tree), whose
   * prefix is causal (causal may be either) */
  const bool tree = mask.has_value() && (mask->scalar_type() == at::kInt || mask->scalar_type() == at::kUInt32);
  if (causal && mask.has_value() && !tree)
    fail(binding_error(KVA_EINVAL, "mask: causal=True and a mask array are exclusive"));
  m.kind = causal ? KVA_MASK_CAUSAL : KVA_MASK_NONE;
  if (tree) {
    same_device(*mask, dev, "mask.array (tree bits)");
    c.mask_view = mask->dim() == 2 ? mask->unsqueeze(0) : *mask;
    m.kind = KVA_MASK_TREE;
    m.array = desc(c.mask_view, "mask.array (tree bits)", true); /* int32: the same bits as u32 */
  } else if (mask.has_value()) {
    same_device(*mask, dev, "mask.array");
    m.kind = KVA_MASK_ARRAY;
    c.mask_view = *mask;
    /* broadcast to [B, H, L, N] by strides (stride 0) when the shape allows;
     * otherwise the library names the dimension */
    const int64_t full[4] = {B, H, L, N};
    const int64_t nd = mask->dim();
    bool ok = nd <= 4 && N > 0;
    for (int64_t i = 0; ok && i < nd; ++i) {
      const int64_t n = mask->size(nd - 1 - i);
      ok = n == 1 || n == full[3 - i];
    }
    if (ok) c.mask_view = mask->expand({B, H, L, N});
    m.array = desc(c.mask_view, "mask.array");
  }
}

int attn_size(kva_context *ctx, AttnCall &c, kva_tensor *out, size_t *bytes) {
  (void)out;
  return kva_attention_workspace_size(ctx, &c.q, &c.view, &c.params, bytes);
}

void attend(const Tensor &q, const Tensor &k, const Tensor &v, const OptTensor &seq_lens, const TableArgs *tab,
            const Tensor &out, const Tensor *lse, bool lse_base2, KVA_OPT_PARAMS) {
  AttnCall c;
  build_call(c, q, k, v, seq_lens, tab, KVA_OPT_ARGS);
  const at::Device dev = q.device();
  same_device(out, dev, "out");
  kva_tensor o = desc(out, "out");
  kva_tensor l{};
  if (lse) {
    same_device(*lse, dev, "lse");
    l = desc(*lse, "lse");
  }
  const unsigned lf = lse_base2 ? KVA_LSE_BASE2 : 0u;
  run(
      dev,
      [&](kva_context *ctx, void *ws, size_t bytes) {
        return kva_attention_lse(ctx, &c.q, &c.view, &c.params, &o, lse ? &l : nullptr, lse ? lf : 0u, ws, bytes);
      },
      [&](kva_context *ctx, size_t *bytes) { return attn_size(ctx, c, &o, bytes); });
}

at::ScalarType out_dtype(const Tensor &q) { return is_float(q.scalar_type()) ? q.scalar_type() : at::kFloat; }

/* [B, H, L, Dv] of a call (1s for a q of the wrong rank: the library reports it). */
std::vector<c10::SymInt> out_shape(const Tensor &q, const Tensor &v, int64_t bits) {
  std::vector<c10::SymInt> s;
  for (int i = 0; i < 3; ++i) s.push_back(q.dim() == 4 ? q.sym_size(i) : c10::SymInt(1));
  c10::SymInt dv = v.dim() ? v.sym_size(-1) : c10::SymInt(1);
  if (bits == 2 || bits == 4 || bits == 8) dv = dv * kWordBits / bits;
  s.push_back(bits == 0 || bits == 2 || bits == 4 || bits == 8 ? dv : c10::SymInt(1));
  return s;
}

Tensor new_out(const Tensor &q, const Tensor &v, int64_t bits) {
  if (!q.unsafeGetTensorImpl()->has_symbolic_sizes_strides() &&
      !v.unsafeGetTensorImpl()->has_symbolic_sizes_strides()) { /* eager: concrete sizes, no SymInt vector */
    int64_t s[4];
    for (int i = 0; i < 3; ++i) s[i] = q.dim() == 4 ? q.size(i) : 1;
    const int64_t last = v.dim() ? v.size(-1) : 1;
    s[3] = bits == 0 ? last : (bits == 2 || bits == 4 || bits == 8) ? last * kWordBits / bits : 1;
    return at::empty(at::IntArrayRef(s, 4), q.options().dtype(out_dtype(q)));
  }
  std::vector<c10::SymInt> s = out_shape(q, v, bits);
  return at::empty_symint(s, q.options().dtype(out_dtype(q)));
}
Tensor new_lse(const Tensor &q) {
  std::vector<c10::SymInt> s;
  for (int i = 0; i < 3; ++i) s.push_back(q.dim() == 4 ? q.sym_size(i) : c10::SymInt(1));
  return at::empty_symint(s, q.options().dtype(at::kFloat));
}

/* ---- contiguous K/V */
Tensor attention(const Tensor &q, const Tensor &k, const Tensor &v, KVA_OPT_PARAMS, const OptTensor &seq_lens) {
  Tensor out = new_out(q, v, bits);
  attend(q, k, v, seq_lens, nullptr, out, nullptr, false, KVA_OPT_ARGS);
  return out;
}
void attention_out(const Tensor &out, const Tensor &q, const Tensor &k, const Tensor &v, KVA_OPT_PARAMS,
                   const OptTensor &seq_lens) {
  attend(q, k, v, seq_lens, nullptr, out, nullptr, false, KVA_OPT_ARGS);
}
std::tuple<Tensor, Tensor> attention_lse(const Tensor &q, const Tensor &k, const Tensor &v, KVA_OPT_PARAMS,
                                         const OptTensor &seq_lens, bool lse_base2) {
  Tensor out = new_out(q, v, bits), lse = new_lse(q);
  attend(q, k, v, seq_lens, nullptr, out, &lse, lse_base2, KVA_OPT_ARGS);
  return {out, lse};
}
void attention_lse_out(const Tensor &out, const Tensor &lse, const Tensor &q, const Tensor &k, const Tensor &v,
                       KVA_OPT_PARAMS, const OptTensor &seq_lens, bool lse_base2) {
  attend(q, k, v, seq_lens, nullptr, out, &lse, lse_base2, KVA_OPT_ARGS);
}

/* ---- block-table K/V */
Tensor block_table_attention(const Tensor &q, const Tensor &k_pool, const Tensor &v_pool, const Tensor &block_table,
                             const Tensor &seq_lens, const OptTensor &first_offset, KVA_OPT_PARAMS) {
  TableArgs t{&block_table, &seq_lens, &first_offset};
  Tensor out = new_out(q, v_pool, bits);
  attend(q, k_pool, v_pool, std::nullopt, &t, out, nullptr, false, KVA_OPT_ARGS);
  return out;
}
void block_table_attention_out(const Tensor &out, const Tensor &q, const Tensor &k_pool, const Tensor &v_pool,
                               const Tensor &block_table, const Tensor &seq_lens, const OptTensor &first_offset,
                               KVA_OPT_PARAMS) {
  TableArgs t{&block_table, &seq_lens, &first_offset};
  attend(q, k_pool, v_pool, std::nullopt, &t, out, nullptr, false, KVA_OPT_ARGS);
}
std::tuple<Tensor, Tensor> block_table_attention_lse(const Tensor &q, const Tensor &k_pool, const Tensor &v_pool,
                                                     const Tensor &block_table, const Tensor &seq_lens,
                                                     const OptTensor &first_offset, KVA_OPT_PARAMS, bool lse_base2) {
  TableArgs t{&block_table, &seq_lens, &first_offset};
  Tensor out = new_out(q, v_pool, bits), lse = new_lse(q);
  attend(q, k_pool, v_pool, std::nullopt, &t, out, &lse, lse_base2, KVA_OPT_ARGS);
  return {out, lse};
}
void block_table_attention_lse_out(const Tensor &out, const Tensor &lse, const Tensor &q, const Tensor &k_pool,
                                   const Tensor &v_pool, const Tensor &block_table, const Tensor &seq_lens,
                                   const OptTensor &first_offset, KVA_OPT_PARAMS, bool lse_base2) {
  TableArgs t{&block_table, &seq_lens, &first_offset};
  attend(q, k_pool, v_pool, std::nullopt, &t, out, &lse, lse_base2, KVA_OPT_ARGS);
}

/* ---- meta (shape) kernels: outputs of the functional ops; the *_out ops write nothing */
#define KVA_UNUSED_OPTS                                                                                         \
  (void)k_scales, (void)k_biases, (void)v_scales, (void)v_biases, (void)bits, (void)group_size, (void)scale,  \
      (void)causal, (void)window, (void)segments, (void)clamp, (void)mask, (void)softcap, (void)sinks, (void)exact

Tensor attention_meta(const Tensor &q, const Tensor &, const Tensor &v, KVA_OPT_PARAMS, const OptTensor &) {
  KVA_UNUSED_OPTS;
  return new_out(q, v, bits);
}
void attention_out_meta(const Tensor &, const Tensor &, const Tensor &, const Tensor &, KVA_OPT_PARAMS,
                        const OptTensor &) {
  KVA_UNUSED_OPTS;
}
std::tuple<Tensor, Tensor> attention_lse_meta(const Tensor &q, const Tensor &, const Tensor &v, KVA_OPT_PARAMS,
                                              const OptTensor &, bool) {
  KVA_UNUSED_OPTS;
  return {new_out(q, v, bits), new_lse(q)};
}
void attention_lse_out_meta(const Tensor &, const Tensor &, const Tensor &, const Tensor &, const Tensor &,
                            KVA_OPT_PARAMS, const OptTensor &, bool) {
  KVA_UNUSED_OPTS;
}
Tensor block_table_attention_meta(const Tensor &q, const Tensor &, const Tensor &v_pool, const Tensor &,
                                  const Tensor &, const OptTensor &, KVA_OPT_PARAMS) {
  KVA_UNUSED_OPTS;
  return new_out(q, v_pool, bits);
}
void block_table_attention_out_meta(const Tensor &, const Tensor &, const Tensor &, const Tensor &, const Tensor &,
                                    const Tensor &, const OptTensor &, KVA_OPT_PARAMS) {
  KVA_UNUSED_OPTS;
}
std::tuple<Tensor, Tensor> block_table_attention_lse_meta(const Tensor &q, const Tensor &, const Tensor &v_pool,
                                                          const Tensor &, const Tensor &, const OptTensor &,
                                                          KVA_OPT_PARAMS, bool) {
  KVA_UNUSED_OPTS;
  return {new_out(q, v_pool, bits), new_lse(q)};
}
void block_table_attention_lse_out_meta(const Tensor &, const Tensor &, const Tensor &, const Tensor &, const Tensor &,
                                        const Tensor &, const Tensor &, const OptTensor &, KVA_OPT_PARAMS, bool) {
  KVA_UNUSED_OPTS;
}

/* ----------------------------------------------------------- cache write */
void write_rows(const kva_kv &kp, const kva_kv &vp, const Tensor &k, const Tensor &v, const Tensor &slots,
                const at::Device &dev) {
  same_device(k, dev, "k");
  same_device(v, dev, "v");
  const kva_tensor kt = desc(k, "k"), vt = desc(v, "v");
  const int64_t n = k.dim() ? k.size(0) : 0;
  const int32_t *sl = (const int32_t *)vector_arg(slots, "slots", at::kInt, n, dev);
  run(
      dev, [&](kva_context *ctx, void *, size_t) { return kva_cache_write(ctx, &kp, &vp, &kt, &vt, sl, n); },
      nullptr);
}

void cache_write(const Tensor &k_pool, const Tensor &v_pool, const Tensor &k, const Tensor &v, const Tensor &slots) {
  const at::Device dev = k_pool.device();
  const kva_kv kp = kv_of(k_pool, std::nullopt, std::nullopt, 0, 0, {"k_pool.data", "", ""}, dev);
  const kva_kv vp = kv_of(v_pool, std::nullopt, std::nullopt, 0, 0, {"v_pool.data", "", ""}, dev);
  write_rows(kp, vp, k, v, slots, dev);
}
void cache_write_quantized(const Tensor &k_pool, const Tensor &k_scales, const Tensor &k_biases, const Tensor &v_pool,
                           const Tensor &v_scales, const Tensor &v_biases, const Tensor &k, const Tensor &v,
                           const Tensor &slots, int64_t bits, int64_t group_size) {
  const at::Device dev = k_pool.device();
  const int b = int32_arg(bits, "bits"), g = int32_arg(group_size, "group_size");
  if (b == 0) fail(binding_error(KVA_EINVAL, "bits = 0: cache_write_quantized needs packed pools (bits 2, 4 or 8)"));
  const kva_kv kp = kv_of(k_pool, k_scales, k_biases, b, g, {"k_pool.data", "k_pool.scales", "k_pool.biases"}, dev);
  const kva_kv vp = kv_of(v_pool, v_scales, v_biases, b, g, {"v_pool.data", "v_pool.scales", "v_pool.biases"}, dev);
  write_rows(kp, vp, k, v, slots, dev);
}
void cache_write_meta(const Tensor &, const Tensor &, const Tensor &, const Tensor &, const Tensor &) {}
void cache_write_quantized_meta(const Tensor &, const Tensor &, const Tensor &, const Tensor &, const Tensor &,
                                const Tensor &, const Tensor &, const Tensor &, const Tensor &, int64_t, int64_t) {}

/* ---------------------------------------------------- Hadamard rotation */
/* hadamard_out(out, x): out = H x on the last dim (kva_hadamard; out may be x). */
void hadamard_out(const Tensor &out, const Tensor &x) {
  const at::Device dev = x.device();
  same_device(out, dev, "y");
  const kva_tensor tx = desc(x, "x");
  kva_tensor ty = desc(out, "y");
  run(dev, [&](kva_context *ctx, void *, size_t) { return kva_hadamard(ctx, &tx, &ty); }, nullptr);
}
Tensor hadamard(const Tensor &x) {
  Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
  hadamard_out(out, x);
  return out;
}
Tensor hadamard_meta(const Tensor &x) { return at::empty_like(x, at::MemoryFormat::Contiguous); }
void hadamard_out_meta(const Tensor &, const Tensor &) {}

/* cache_write_rotated: kva_cache_write_ex with its rotation flags; bits 0 =
 * float pools (scales and biases None), else (packed, scales, biases) pools. */
void cache_write_rotated(const Tensor &k_pool, const OptTensor &k_scales, const OptTensor &k_biases,
                         const Tensor &v_pool, const OptTensor &v_scales, const OptTensor &v_biases, const Tensor &k,
                         const Tensor &v, const Tensor &slots, int64_t bits, int64_t group_size, int64_t flags) {
  const at::Device dev = k_pool.device();
  const int b = int32_arg(bits, "bits"), g = int32_arg(group_size, "group_size");
  const unsigned f = (unsigned)int32_arg(flags, "flags");
  const kva_kv kp = kv_of(k_pool, k_scales, k_biases, b, g, {"k_pool.data", "k_pool.scales", "k_pool.biases"}, dev);
  const kva_kv vp = kv_of(v_pool, v_scales, v_biases, b, g, {"v_pool.data", "v_pool.scales", "v_pool.biases"}, dev);
  same_device(k, dev, "k");
  same_device(v, dev, "v");
  const kva_tensor kt = desc(k, "k"), vt = desc(v, "v");
  const int64_t n = k.dim() ? k.size(0) : 0;
  const int32_t *sl = (const int32_t *)vector_arg(slots, "slots", at::kInt, n, dev);
  run(
      dev, [&](kva_context *ctx, void *, size_t) { return kva_cache_write_ex(ctx, &kp, &vp, &kt, &vt, sl, n, f); },
      nullptr);
}
void cache_write_rotated_meta(const Tensor &, const OptTensor &, const OptTensor &, const Tensor &, const OptTensor &,
                              const OptTensor &, const Tensor &, const Tensor &, const Tensor &, int64_t, int64_t,
                              int64_t) {}

/* ---------------------------------------------------------- merge states */
/* R = the number of parts: one lse per o, 1 <= R <= KVA_MERGE_MAX_PARTS. */
int64_t check_parts(const at::TensorList parts_o, const at::TensorList parts_lse) {
  const int64_t R = (int64_t)parts_o.size();
  if ((int64_t)parts_lse.size() != R)
    fail(binding_error(KVA_EINVAL, "parts_o has " + std::to_string(R) + " tensors, parts_lse " +
                                       std::to_string(parts_lse.size()) + " (one lse per part)"));
  if (R < 1 || R > KVA_MERGE_MAX_PARTS)
    fail(binding_error(KVA_EINVAL, "merge_states: R = " + std::to_string(R) + " parts (1 to " +
                                       std::to_string(KVA_MERGE_MAX_PARTS) + "; merge more in steps)"));
  return R;
}

void merge(const at::TensorList parts_o, const at::TensorList parts_lse, const Tensor &out, const Tensor &lse,
           bool base2) {
  const int64_t R = check_parts(parts_o, parts_lse);
  const at::Device dev = out.device();
  kva_tensor to[KVA_MERGE_MAX_PARTS], tl[KVA_MERGE_MAX_PARTS];
  static const char *const on[4] = {"parts_o[0]", "parts_o[1]", "parts_o[2]", "parts_o[r]"};
  static const char *const ln[4] = {"parts_lse[0]", "parts_lse[1]", "parts_lse[2]", "parts_lse[r]"};
  for (int64_t r = 0; r < R; ++r) {
    same_device(parts_o[r], dev, on[std::min<int64_t>(r, 3)]);
    same_device(parts_lse[r], dev, ln[std::min<int64_t>(r, 3)]);
    to[r] = desc(parts_o[r], on[std::min<int64_t>(r, 3)]);
    tl[r] = desc(parts_lse[r], ln[std::min<int64_t>(r, 3)]);
  }
  same_device(lse, dev, "lse_out");
  kva_tensor o = desc(out, "out"), l = desc(lse, "lse_out");
  const unsigned f = base2 ? KVA_LSE_BASE2 : 0u;
  run(
      dev, [&](kva_context *ctx, void *, size_t) { return kva_merge_states(ctx, R, to, tl, &o, &l, f); }, nullptr);
}

std::tuple<Tensor, Tensor> merge_states(at::TensorList parts_o, at::TensorList parts_lse, bool base2,
                                        std::optional<at::ScalarType> dtype) {
  check_parts(parts_o, parts_lse);
  const Tensor &o0 = parts_o[0];
  Tensor out = at::empty_symint(o0.sym_sizes(), o0.options().dtype(dtype.value_or(o0.scalar_type())));
  Tensor lse = at::empty_symint(parts_lse[0].sym_sizes(), parts_lse[0].options().dtype(at::kFloat));
  merge(parts_o, parts_lse, out, lse, base2);
  return {out, lse};
}
void merge_states_out(const Tensor &out, const Tensor &lse, at::TensorList parts_o, at::TensorList parts_lse,
                      bool base2) {
  merge(parts_o, parts_lse, out, lse, base2);
}
std::tuple<Tensor, Tensor> merge_states_meta(at::TensorList parts_o, at::TensorList parts_lse, bool,
                                             std::optional<at::ScalarType> dtype) {
  check_parts(parts_o, parts_lse);
  const Tensor &o0 = parts_o[0];
  return {at::empty_symint(o0.sym_sizes(), o0.options().dtype(dtype.value_or(o0.scalar_type()))),
          at::empty_symint(parts_lse[0].sym_sizes(), parts_lse[0].options().dtype(at::kFloat))};
}
void merge_states_out_meta(const Tensor &, const Tensor &, at::TensorList, at::TensorList, bool) {}

/* ---- information */
std::string version() { return kva_version(); }

} // namespace

#ifdef KVATTN_TORCH_PYTHON
/* ------------------------------------------------- the eager Python entry
 * The same calls as the operators for plain eager tensors, entered from
 * Python directly (METH_FASTCALL, positional arguments in the schemas'
 * order) rather than through the dispatcher's argument parsing: the module
 * libkvattn_torch (this file, imported by kvattn.torch_ops next to
 * torch.ops.load_library). A call it cannot serve as the dispatcher would
 * (a tensor subclass such as FakeTensor or FunctionalTensor, a dispatch
 * mode, functorch transforms, autocast or other included keys) returns
 * NotImplemented, and the caller takes the operator; under torch.compile
 * the caller always takes the operator. */
namespace {

const c10::DispatchKeySet kNotPlain({c10::DispatchKey::Python, c10::DispatchKey::Functionalize,
                                     c10::DispatchKey::FuncTorchBatched, c10::DispatchKey::FuncTorchGradWrapper,
                                     c10::DispatchKey::Batched, c10::DispatchKey::PythonTLSSnapshot});

/* A plain strided torch.Tensor (not a subclass) without wrapper keys. */
const Tensor *plain(PyObject *o) {
  if (!THPVariable_CheckExact(o)) return nullptr;
  const Tensor &t = THPVariable_Unpack(o);
  if (t.layout() != at::kStrided || t.key_set().has_any(kNotPlain)) return nullptr;
  return &t;
}

bool eager_plain() {
  if (c10::impl::TorchDispatchModeTLS::any_modes_set()) return false;
  return (c10::impl::tls_local_dispatch_key_set().included_ - c10::default_included_set).empty();
}

/* Argument readers: false = not servable here (NotImplemented). */
struct Args {
  PyObject *const *a;
  bool ok = true;
  const Tensor &tensor(int i) {
    const Tensor *t = plain(a[i]);
    if (!t) {
      ok = false;
      static const Tensor none;
      return none;
    }
    return *t;
  }
  OptTensor opt(int i) {
    if (a[i] == Py_None) return std::nullopt;
    const Tensor *t = plain(a[i]);
    if (!t) {
      ok = false;
      return std::nullopt;
    }
    return *t;
  }
  int64_t integer(int i) {
    if (!PyLong_Check(a[i]) || PyBool_Check(a[i])) {
      ok = false;
      return 0;
    }
    const long long v = PyLong_AsLongLong(a[i]);
    if (v == -1 && PyErr_Occurred()) {
      PyErr_Clear();
      ok = false;
    }
    return v;
  }
  std::optional<double> real(int i) {
    if (a[i] == Py_None) return std::nullopt;
    if (!PyFloat_Check(a[i]) && !(PyLong_Check(a[i]) && !PyBool_Check(a[i]))) {
      ok = false;
      return std::nullopt;
    }
    const double v = PyFloat_AsDouble(a[i]);
    if (v == -1.0 && PyErr_Occurred()) {
      PyErr_Clear();
      ok = false;
    }
    return v;
  }
  bool boolean(int i) {
    if (!PyBool_Check(a[i])) ok = false;
    return a[i] == Py_True;
  }
};

/* The options KVA_OPT_PARAMS from args[i0 .. i0 + 15). */
struct Opts {
  OptTensor k_scales, k_biases, v_scales, v_biases, segments, mask, sinks;
  int64_t bits, group_size, window;
  std::optional<double> scale, softcap;
  bool causal, clamp, exact;
  void read(Args &r, int i) { /* KVA_OPT_PARAMS' order */
    causal = r.boolean(i), k_scales = r.opt(i + 1), k_biases = r.opt(i + 2), v_scales = r.opt(i + 3);
    v_biases = r.opt(i + 4), bits = r.integer(i + 5), group_size = r.integer(i + 6), window = r.integer(i + 7);
    scale = r.real(i + 8), softcap = r.real(i + 9), sinks = r.opt(i + 10), segments = r.opt(i + 11);
    clamp = r.boolean(i + 12), mask = r.opt(i + 13), exact = r.boolean(i + 14);
  }
};
constexpr int kOpts = 15;
#define KVA_OPTS_OF(o)                                                                                          \
  o.causal, o.k_scales, o.k_biases, o.v_scales, o.v_biases, o.bits, o.group_size, o.window, o.scale, o.softcap,  \
      o.sinks, o.segments, o.clamp, o.mask, o.exact

/* Runs body() without the GIL; a library or binding error becomes a
 * Python ValueError (other torch errors RuntimeError). Returns false with
 * the Python error set. */
template <class Body>
bool call_released(Body body) {
  std::string err;
  PyObject *type = nullptr;
  Py_BEGIN_ALLOW_THREADS;
  try {
    body();
  } catch (const c10::ValueError &e) {
    err = e.what_without_backtrace(), type = PyExc_ValueError;
  } catch (const c10::Error &e) {
    err = e.what_without_backtrace(), type = PyExc_RuntimeError;
  } catch (const std::exception &e) {
    err = e.what(), type = PyExc_RuntimeError;
  }
  Py_END_ALLOW_THREADS;
  if (type) PyErr_SetString(type, err.c_str());
  return type == nullptr;
}

bool nargs_ok(Py_ssize_t n, Py_ssize_t want, const char *fn) {
  if (n == want) return true;
  PyErr_Format(PyExc_TypeError, "%s takes %zd positional arguments (%zd given)", fn, want, n);
  return false;
}

/* attention_out(out, q, k, v, <15 options>, seq_lens) */
PyObject *py_attention_out(PyObject *, PyObject *const *args, Py_ssize_t n) {
  if (!nargs_ok(n, 5 + kOpts, "attention_out")) return nullptr;
  Args r{args};
  const Tensor &out = r.tensor(0), &q = r.tensor(1), &k = r.tensor(2), &v = r.tensor(3);
  Opts o;
  o.read(r, 4);
  OptTensor seq_lens = r.opt(4 + kOpts);
  if (!r.ok || !eager_plain()) Py_RETURN_NOTIMPLEMENTED;
  if (!call_released([&] { attend(q, k, v, seq_lens, nullptr, out, nullptr, false, KVA_OPTS_OF(o)); }))
    return nullptr;
  Py_RETURN_NONE;
}

/* attention(q, k, v, <15 options>, seq_lens) -> out */
PyObject *py_attention(PyObject *, PyObject *const *args, Py_ssize_t n) {
  if (!nargs_ok(n, 4 + kOpts, "attention")) return nullptr;
  Args r{args};
  const Tensor &q = r.tensor(0), &k = r.tensor(1), &v = r.tensor(2);
  Opts o;
  o.read(r, 3);
  OptTensor seq_lens = r.opt(3 + kOpts);
  if (!r.ok || !eager_plain()) Py_RETURN_NOTIMPLEMENTED;
  Tensor out;
  if (!call_released([&] {
        out = new_out(q, v, o.bits);
        attend(q, k, v, seq_lens, nullptr, out, nullptr, false, KVA_OPTS_OF(o));
      }))
    return nullptr;
  return THPVariable_Wrap(std::move(out));
}

/* block_table_attention_out(out, q, k_pool, v_pool, block_table, seq_lens, first_offset, <15 options>) */
PyObject *py_block_table_attention_out(PyObject *, PyObject *const *args, Py_ssize_t n) {
  if (!nargs_ok(n, 7 + kOpts, "block_table_attention_out")) return nullptr;
  Args r{args};
  const Tensor &out = r.tensor(0), &q = r.tensor(1), &kp = r.tensor(2), &vp = r.tensor(3);
  const Tensor &bt = r.tensor(4), &sl = r.tensor(5);
  OptTensor fo = r.opt(6);
  Opts o;
  o.read(r, 7);
  if (!r.ok || !eager_plain()) Py_RETURN_NOTIMPLEMENTED;
  TableArgs t{&bt, &sl, &fo};
  if (!call_released([&] { attend(q, kp, vp, std::nullopt, &t, out, nullptr, false, KVA_OPTS_OF(o)); }))
    return nullptr;
  Py_RETURN_NONE;
}

/* block_table_attention(q, k_pool, v_pool, block_table, seq_lens, first_offset, <15 options>) -> out */
PyObject *py_block_table_attention(PyObject *, PyObject *const *args, Py_ssize_t n) {
  if (!nargs_ok(n, 6 + kOpts, "block_table_attention")) return nullptr;
  Args r{args};
  const Tensor &q = r.tensor(0), &kp = r.tensor(1), &vp = r.tensor(2), &bt = r.tensor(3), &sl = r.tensor(4);
  OptTensor fo = r.opt(5);
  Opts o;
  o.read(r, 6);
  if (!r.ok || !eager_plain()) Py_RETURN_NOTIMPLEMENTED;
  TableArgs t{&bt, &sl, &fo};
  Tensor out;
  if (!call_released([&] {
        out = new_out(q, vp, o.bits);
        attend(q, kp, vp, std::nullopt, &t, out, nullptr, false, KVA_OPTS_OF(o));
      }))
    return nullptr;
  return THPVariable_Wrap(std::move(out));
}

PyMethodDef g_methods[] = {
    {"attention_out", (PyCFunction)(void (*)(void))py_attention_out, METH_FASTCALL,
     "attention_out(out, q, k, v, causal, k_scales, k_biases, v_scales, v_biases, bits, group_size, window, "
     "scale, softcap, sinks, segments, clamp, mask, exact, seq_lens): torch.ops.kvattn.attention_out for plain "
     "eager tensors; NotImplemented where the dispatcher is needed"},
    {"attention", (PyCFunction)(void (*)(void))py_attention, METH_FASTCALL,
     "attention(q, k, v, <options as attention_out>, seq_lens) -> out"},
    {"block_table_attention_out", (PyCFunction)(void (*)(void))py_block_table_attention_out, METH_FASTCALL,
     "block_table_attention_out(out, q, k_pool, v_pool, block_table, seq_lens, first_offset, <options>)"},
    {"block_table_attention", (PyCFunction)(void (*)(void))py_block_table_attention, METH_FASTCALL,
     "block_table_attention(q, k_pool, v_pool, block_table, seq_lens, first_offset, <options>) -> out"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef g_module = {PyModuleDef_HEAD_INIT, "libkvattn_torch",
                        "kvattn's eager entry points for plain torch tensors (see kvattn.torch_ops)", -1,
                        g_methods, nullptr, nullptr, nullptr, nullptr};

} // namespace

extern "C" __attribute__((visibility("default"))) PyObject *PyInit_libkvattn_torch(void) {
  return PyModule_Create(&g_module);
}
#endif

#define KVA_ATTN "Tensor q, Tensor k, Tensor v, " KVA_OPT_SCHEMA ", Tensor? seq_lens=None"
#define KVA_TABLE                                                                                               \
  "Tensor q, Tensor k_pool, Tensor v_pool, Tensor block_table, Tensor seq_lens, Tensor? first_offset=None, "   \
  KVA_OPT_SCHEMA

TORCH_LIBRARY(kvattn, m) {
  m.def("attention(" KVA_ATTN ") -> Tensor");
  m.def("attention_out(Tensor(a!) out, " KVA_ATTN ") -> ()");
  m.def("attention_lse(" KVA_ATTN ", bool lse_base2=False) -> (Tensor, Tensor)");
  m.def("attention_lse_out(Tensor(a!) out, Tensor(b!) lse, " KVA_ATTN ", bool lse_base2=False) -> ()");
  m.def("block_table_attention(" KVA_TABLE ") -> Tensor");
  m.def("block_table_attention_out(Tensor(a!) out, " KVA_TABLE ") -> ()");
  m.def("block_table_attention_lse(" KVA_TABLE ", bool lse_base2=False) -> (Tensor, Tensor)");
  m.def("block_table_attention_lse_out(Tensor(a!) out, Tensor(b!) lse, " KVA_TABLE ", bool lse_base2=False) -> ()");
  m.def("cache_write(Tensor(a!) k_pool, Tensor(b!) v_pool, Tensor k, Tensor v, Tensor slots) -> ()");
  m.def("cache_write_quantized(Tensor(a!) k_pool, Tensor(b!) k_scales, Tensor(c!) k_biases, Tensor(d!) v_pool, "
        "Tensor(e!) v_scales, Tensor(f!) v_biases, Tensor k, Tensor v, Tensor slots, int bits=4, "
        "int group_size=64) -> ()");
  m.def("merge_states(Tensor[] parts_o, Tensor[] parts_lse, bool base2=False, ScalarType? dtype=None) -> "
        "(Tensor, Tensor)");
  m.def("merge_states_out(Tensor(a!) out, Tensor(b!) lse, Tensor[] parts_o, Tensor[] parts_lse, "
        "bool base2=False) -> ()");
  m.def("hadamard(Tensor x) -> Tensor");
  m.def("hadamard_out(Tensor(a!) out, Tensor x) -> ()");
  m.def("cache_write_rotated(Tensor(a!) k_pool, Tensor(b!)? k_scales, Tensor(c!)? k_biases, Tensor(d!) v_pool, "
        "Tensor(e!)? v_scales, Tensor(f!)? v_biases, Tensor k, Tensor v, Tensor slots, int bits, int group_size, "
        "int flags) -> ()");
  m.def("version() -> str", &version);
}

#define KVA_IMPLS(m, sfx)                                                                                       \
  m.impl("attention", TORCH_FN(attention##sfx));                                                               \
  m.impl("attention_out", TORCH_FN(attention_out##sfx));                                                       \
  m.impl("attention_lse", TORCH_FN(attention_lse##sfx));                                                       \
  m.impl("attention_lse_out", TORCH_FN(attention_lse_out##sfx));                                               \
  m.impl("block_table_attention", TORCH_FN(block_table_attention##sfx));                                       \
  m.impl("block_table_attention_out", TORCH_FN(block_table_attention_out##sfx));                               \
  m.impl("block_table_attention_lse", TORCH_FN(block_table_attention_lse##sfx));                               \
  m.impl("block_table_attention_lse_out", TORCH_FN(block_table_attention_lse_out##sfx));                       \
  m.impl("cache_write", TORCH_FN(cache_write##sfx));                                                           \
  m.impl("cache_write_quantized", TORCH_FN(cache_write_quantized##sfx));                                       \
  m.impl("merge_states", TORCH_FN(merge_states##sfx));                                                         \
  m.impl("merge_states_out", TORCH_FN(merge_states_out##sfx));                                                 \
  m.impl("hadamard", TORCH_FN(hadamard##sfx));                                                                 \
  m.impl("hadamard_out", TORCH_FN(hadamard_out##sfx));                                                         \
  m.impl("cache_write_rotated", TORCH_FN(cache_write_rotated##sfx))

TORCH_LIBRARY_IMPL(kvattn, CPU, m) { KVA_IMPLS(m, ); }
TORCH_LIBRARY_IMPL(kvattn, CUDA, m) { KVA_IMPLS(m, ); }
TORCH_LIBRARY_IMPL(kvattn, Meta, m) { KVA_IMPLS(m, _meta); }

/* The operators have no derivative and track no views: the autograd and
 * ADInplaceOrView keys are fallthroughs, so a call goes straight to its
 * backend (or Python / meta) kernel, unboxed, instead of through the boxed
 * autograd fallback, which re-boxes every argument (the larger part of the
 * dispatcher's host time per call). Outputs do not require grad, and the
 * _out forms do not bump the version counters of the tensors they write. */
#define KVA_FALLTHROUGH(m)                                                                                      \
  for (const char *name : {"attention", "attention_out", "attention_lse", "attention_lse_out",                 \
                           "block_table_attention", "block_table_attention_out", "block_table_attention_lse",  \
                           "block_table_attention_lse_out", "cache_write", "cache_write_quantized",            \
                           "merge_states", "merge_states_out", "hadamard", "hadamard_out",                     \
                           "cache_write_rotated"})                                                             \
    m.impl(name, torch::CppFunction::makeFallthrough())
TORCH_LIBRARY_IMPL(kvattn, Autograd, m) { KVA_FALLTHROUGH(m); }
TORCH_LIBRARY_IMPL(kvattn, ADInplaceOrView, m) { KVA_FALLTHROUGH(m); }
