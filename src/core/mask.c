/* Mask materializers (the seed's createCausalMask / bidirMask, generalized to
 * several images by segment ids). The attention kernels never read these
 * matrices: they evaluate the same rule (kva_causal_visible) per key. */
#include "problem.h"

int kva_causal_mask(int64_t n, int64_t offset, int32_t window, kva_tensor *out) {
  kva_clearerr();
  if (n <= 0) return kva_seterr(KVA_EINVAL, "n = %lld must be positive", (long long)n);
  if (offset < 0) return kva_seterr(KVA_EINVAL, "offset = %lld must be >= 0", (long long)offset);
  if (window < 0) return kva_seterr(KVA_EINVAL, "window = %d must be > 0 (or 0 for none)", window);
  int64_t cols;
  if (!kva_add_ok(offset, n, &cols))
    return kva_seterr(KVA_EINVAL, "offset + n = %lld + %lld overflows int64", (long long)offset, (long long)n);
  int rc = kva_check_tensor(out, "out", KVA_DT(KVA_BOOL), 2, false);
  if (rc) return rc;
  if (out->shape[0] != n || out->shape[1] != cols)
    return kva_seterr(KVA_ESHAPE, "out must be [%lld, %lld], got [%lld, %lld]", (long long)n,
                      (long long)cols, (long long)out->shape[0], (long long)out->shape[1]);
  for (int64_t r = 0; r < n; ++r)
    for (int64_t j = 0; j < offset + n; ++j)
      *((uint8_t *)out->data + r * out->stride[0] + j * out->stride[1]) =
          (uint8_t)kva_causal_visible(j, offset + r, window, NULL, 0, NULL, 0);
  return 0;
}

int kva_image_mask(const kva_tensor *segments, int32_t window, int clamp, kva_tensor *out) {
  kva_clearerr();
  if (window < 0) return kva_seterr(KVA_EINVAL, "window = %d must be > 0 (or 0 for none)", window);
  int rc = kva_check_tensor(segments, "segments", KVA_DT(KVA_I32), 1, false);
  if (rc) return rc;
  rc = kva_check_tensor(out, "out", KVA_DT(KVA_BOOL), 2, false);
  if (rc) return rc;
  int64_t n = segments->shape[0];
  if (out->shape[0] != n || out->shape[1] != n)
    return kva_seterr(KVA_ESHAPE, "out must be [%lld, %lld] (segments length), got [%lld, %lld]",
                      (long long)n, (long long)n, (long long)out->shape[0], (long long)out->shape[1]);
  if (kva_tensors_overlap(segments, out))
    return kva_seterr(KVA_EINVAL, "out overlaps segments");
  /* Gather the segment ids contiguously (segments may be strided). */
  int32_t stackbuf[256];
  int32_t *seg = n <= 256 ? stackbuf : (int32_t *)malloc((size_t)n * sizeof *seg);
  if (!seg) return kva_seterr(KVA_ENOMEM, "segments copy of %lld ids", (long long)n);
  for (int64_t i = 0; i < n; ++i) {
    seg[i] = *(const int32_t *)((const char *)segments->data + i * segments->stride[0]);
    if (seg[i] < 0) {
      const int32_t bad = seg[i];
      if (seg != stackbuf) free(seg);
      return kva_seterr(KVA_EINVAL, "segments[%lld] = %d: segment ids are 0 (text) or > 0 (image k)", (long long)i, bad);
    }
  }
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < n; ++j)
      *((uint8_t *)out->data + i * out->stride[0] + j * out->stride[1]) =
          (uint8_t)kva_causal_visible(j, i, window, seg, clamp, NULL, 0);
  if (seg != stackbuf) free(seg);
  return 0;
}
