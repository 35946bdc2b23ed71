/* The one test binary's tiny framework. Each tests/ C file registers
 * TEST(name) functions; main.c runs them (filter by substring) and prints
 * "N passed, N failed, N skipped". ASSERT_* print both sides. */
#ifndef KVA_TEST_H
#define KVA_TEST_H

#include "kvattn.h"

#include <inttypes.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef void (*test_fn)(void);
void test_register(const char *name, test_fn fn, bool slow);

/* Per-test state (main.c). */
extern int test_failed_flag, test_skipped_flag;
extern bool test_quick; /* --quick: smaller case tables (used under sanitizers) */
extern const char *test_current_name; /* the running test's name */
/* Whether case ci of a large table of ncases runs: always, unless --sample N
 * (one case in N, chosen by the seed per test; at least one per table). */
bool test_case_sampled(long ci, long ncases);

#define TEST_(name, slow)                                                        \
  static void test_##name(void);                                                 \
  __attribute__((constructor)) static void reg_##name(void) {                    \
    test_register(#name, test_##name, slow);                                     \
  }                                                                              \
  static void test_##name(void)
#define TEST(name) TEST_(name, false)
#define TEST_SLOW(name) TEST_(name, true) /* skipped with --quick */

#define FAIL_(...)                                                               \
  do {                                                                           \
    fprintf(stderr, "  FAIL %s:%d: ", __FILE__, __LINE__);                       \
    fprintf(stderr, __VA_ARGS__);                                                \
    fprintf(stderr, "\n");                                                       \
    test_failed_flag = 1;                                                        \
  } while (0)
#define SKIP(...)                                                                \
  do {                                                                           \
    fprintf(stderr, "  skip: ");                                                 \
    fprintf(stderr, __VA_ARGS__);                                                \
    fprintf(stderr, "\n");                                                       \
    test_skipped_flag = 1;                                                       \
    return;                                                                      \
  } while (0)

#define ASSERT_TRUE(c)                                                           \
  do {                                                                           \
    if (!(c)) { FAIL_("expected %s", #c); return; }                               \
  } while (0)
#define ASSERT_EQ(a, b)                                                          \
  do {                                                                           \
    long long a_ = (long long)(a), b_ = (long long)(b);                          \
    if (a_ != b_) { FAIL_("%s == %s: %lld != %lld", #a, #b, a_, b_); return; }     \
  } while (0)
/* Expect a failing call: status code and a non-empty message containing `needle`. */
#define ASSERT_ERR(call, code, needle)                                           \
  do {                                                                           \
    int rc_ = (call);                                                            \
    if (rc_ != (code)) {                                                         \
      FAIL_("%s returned %d (%s), expected %d; msg: %s", #call, rc_,             \
            kva_strerror(rc_), (int)(code), kva_last_error());                   \
      return;                                                                    \
    }                                                                            \
    if (!strstr(kva_last_error(), (needle))) {                                   \
      FAIL_("%s: message \"%s\" does not mention \"%s\"", #call, kva_last_error(), \
            (needle));                                                           \
      return;                                                                    \
    }                                                                            \
  } while (0)
#define ASSERT_OK(call)                                                          \
  do {                                                                           \
    int rc_ = (call);                                                            \
    if (rc_ < 0) { FAIL_("%s failed: %d %s", #call, rc_, kva_last_error()); return; } \
  } while (0)

/* Deterministic RNG (splitmix64), seeded per test from the test name and
 * --seed, so a failure is reproducible and every run sees fresh values when
 * the seed changes. */
uint64_t test_rand_u64(void);
float test_randn(void);    /* ~N(0,1) */
float test_randu(float lo, float hi);

/* One f32/f16/bf16 element at p as float, and x stored at p rounded to dt
 * (the library's conversions; NaN for other dtypes / nothing stored). */
float test_load(const void *p, kva_dtype dt);
void test_store(void *p, kva_dtype dt, float x);
#endif
