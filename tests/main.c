/* Runs every registered test: kvattn_tests [--quick] [--seed S] [filter...] */
#include "test.h"

#define MAX_TESTS 512
static struct { const char *name; test_fn fn; bool slow; } tests[MAX_TESTS];
static int ntests;
int test_failed_flag, test_skipped_flag;
bool test_quick;
static uint64_t rng_state;

void test_register(const char *name, test_fn fn, bool slow) {
  if (ntests < MAX_TESTS) {
    tests[ntests].name = name;
    tests[ntests].fn = fn;
    tests[ntests].slow = slow;
    ntests++;
  }
}

uint64_t test_rand_u64(void) {
  uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
float test_randu(float lo, float hi) {
  return lo + (hi - lo) * (float)((test_rand_u64() >> 40) * (1.0 / 16777216.0));
}
float test_randn(void) {
  double u1 = ((test_rand_u64() >> 11) + 1) * (1.0 / 9007199254740993.0);
  double u2 = (test_rand_u64() >> 11) * (1.0 / 9007199254740992.0);
  return (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}

float test_load(const void *p, kva_dtype dt) {
  uint16_t h;
  switch (dt) {
  case KVA_F32: { float x; memcpy(&x, p, 4); return x; }
  case KVA_F16: memcpy(&h, p, 2); return kva_f16_to_f32(h);
  case KVA_BF16: memcpy(&h, p, 2); return kva_bf16_to_f32(h);
  default: return NAN;
  }
}
void test_store(void *p, kva_dtype dt, float x) {
  uint16_t h;
  switch (dt) {
  case KVA_F32: memcpy(p, &x, 4); break;
  case KVA_F16: h = kva_f32_to_f16(x); memcpy(p, &h, 2); break;
  case KVA_BF16: h = kva_f32_to_bf16(x); memcpy(p, &h, 2); break;
  default: break;
  }
}

static uint64_t hash_str(const char *s) {
  uint64_t h = 1469598103934665603ull;
  for (; *s; ++s) h = (h ^ (unsigned char)*s) * 1099511628211ull;
  return h;
}

int main(int argc, char **argv) {
  uint64_t seed = 0x6b7661747465ull;
  const char *filters[64];
  int nf = 0;
  for (int i = 1; i < argc; ++i) {
    if (!strcmp(argv[i], "--quick")) test_quick = true;
    else if (!strcmp(argv[i], "--seed") && i + 1 < argc) seed = strtoull(argv[++i], NULL, 0);
    else if (!strcmp(argv[i], "--list")) {
      for (int t = 0; t < ntests; ++t) printf("%s\n", tests[t].name);
      return 0;
    } else if (nf < 64) filters[nf++] = argv[i];
  }
  int passed = 0, failed = 0, skipped = 0;
  printf("kvattn %s tests, seed %llu%s\n", kva_version(), (unsigned long long)seed,
         test_quick ? " (quick)" : "");
  for (int t = 0; t < ntests; ++t) {
    bool match = nf == 0;
    for (int f = 0; f < nf; ++f) match |= strstr(tests[t].name, filters[f]) != NULL;
    if (!match) continue;
    if (test_quick && tests[t].slow) { skipped++; continue; }
    test_failed_flag = test_skipped_flag = 0;
    rng_state = seed ^ hash_str(tests[t].name);
    printf("[ RUN  ] %s\n", tests[t].name);
    fflush(stdout);
    tests[t].fn();
    if (test_failed_flag) { failed++; printf("[ FAIL ] %s\n", tests[t].name); }
    else if (test_skipped_flag) { skipped++; printf("[ SKIP ] %s\n", tests[t].name); }
    else { passed++; printf("[  OK  ] %s\n", tests[t].name); }
    fflush(stdout);
  }
  printf("%d passed, %d failed, %d skipped\n", passed, failed, skipped);
  return failed ? 1 : 0;
}
