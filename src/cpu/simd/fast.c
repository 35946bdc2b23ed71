/* Specialized CPU kernels (per SIMD level): none yet at this level beyond
 * the general kernel; see the selector below. */
#include "cpu/simd/simd.h"

kva_item_fn KFN(select_fast)(const kva_problem *p) {
  (void)p;
  return NULL;
}
