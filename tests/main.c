/* Runs every registered test: kvattn_tests [--quick] [--sample N] [--seed S] [--list] [filter...]
 * (a filter selects the tests whose names contain it; "=name" the one test
 * of that name). Each run draws a fresh seed (time, pid, /dev/urandom) and prints it;
 * --seed S or the environment variable KVATTN_TEST_SEED replays one.
 * --sample N (or KVATTN_TEST_SAMPLE=N): the large case tables run one case
 * in N, which ones drawn from the seed (test_case_sampled): for slow
 * runners (an emulator); over runs every case comes up. */
#include "test.h"

#include <time.h>
#include <unistd.h>

#define MAX_TESTS 512
static struct { const char *name; test_fn fn; bool slow; } tests[MAX_TESTS];
static int ntests;
int test_failed_flag, test_skipped_flag;
bool test_quick;
static unsigned test_sample = 1, test_sample_offset;
const char *test_current_name = "";
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
  case KVA_F8E4M3: return kva_f8e4m3_to_f32(*(const uint8_t *)p);
  case KVA_F8E5M2: return kva_f8e5m2_to_f32(*(const uint8_t *)p);
  default: return NAN;
  }
}
void test_store(void *p, kva_dtype dt, float x) {
  uint16_t h;
  switch (dt) {
  case KVA_F32: memcpy(p, &x, 4); break;
  case KVA_F16: h = kva_f32_to_f16(x); memcpy(p, &h, 2); break;
  case KVA_BF16: h = kva_f32_to_bf16(x); memcpy(p, &h, 2); break;
  case KVA_F8E4M3: *(uint8_t *)p = kva_f32_to_f8e4m3(x); break;
  case KVA_F8E5M2: *(uint8_t *)p = kva_f32_to_f8e5m2(x); break;
  default: break;
  }
}

bool test_case_sampled(long ci, long ncases) {
  const unsigned long n = ncases < (long)test_sample ? (unsigned long)(ncases > 0 ? ncases : 1) : test_sample;
  return n <= 1 || (unsigned long)ci % n == test_sample_offset % n;
}

static uint64_t hash_str(const char *s) {
  uint64_t h = 1469598103934665603ull;
  for (; *s; ++s) h = (h ^ (unsigned char)*s) * 1099511628211ull;
  return h;
}

/* A fresh seed: /dev/urandom, mixed with the time and the pid. */
static uint64_t fresh_seed(void) {
  uint64_t r = 0;
  FILE *f = fopen("/dev/urandom", "rb");
  if (f) {
    if (fread(&r, sizeof r, 1, f) != 1) r = 0;
    fclose(f);
  }
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  r ^= (uint64_t)ts.tv_sec * 1000000007ull ^ (uint64_t)ts.tv_nsec ^ ((uint64_t)getpid() << 40);
  return r >> 11; /* 53 bits: printable and exact as a double for scripts */
}

int main(int argc, char **argv) {
  uint64_t seed = fresh_seed();
  const char *env = getenv("KVATTN_TEST_SEED");
  if (env && *env) seed = strtoull(env, NULL, 0);
  const char *senv = getenv("KVATTN_TEST_SAMPLE");
  if (senv && *senv) test_sample = (unsigned)strtoul(senv, NULL, 0);
  const char *filters[64];
  int nf = 0;
  for (int i = 1; i < argc; ++i) {
    if (!strcmp(argv[i], "--quick")) test_quick = true;
    else if (!strcmp(argv[i], "--sample") && i + 1 < argc) test_sample = (unsigned)strtoul(argv[++i], NULL, 0);
    else if (!strcmp(argv[i], "--seed") && i + 1 < argc) seed = strtoull(argv[++i], NULL, 0);
    else if (!strcmp(argv[i], "--list")) {
      for (int t = 0; t < ntests; ++t) printf("%s\n", tests[t].name);
      return 0;
    } else if (nf < 64) filters[nf++] = argv[i];
  }
  int passed = 0, failed = 0, skipped = 0;
  if (test_sample > 1000) test_sample = 1000;
  char sample_arg[32] = "";
  if (test_sample > 1) snprintf(sample_arg, sizeof sample_arg, " --sample %u", test_sample);
  char sample_note[64] = "";
  if (test_sample > 1) snprintf(sample_note, sizeof sample_note, ", one case in %u of the large tables", test_sample);
  printf("kvattn %s tests, seed %llu%s%s\n", kva_version(), (unsigned long long)seed,
         test_quick ? " (quick)" : "", sample_note);
  for (int t = 0; t < ntests; ++t) {
    bool match = nf == 0;
    for (int f = 0; f < nf; ++f)
      match |= filters[f][0] == '=' ? !strcmp(tests[t].name, filters[f] + 1) : strstr(tests[t].name, filters[f]) != NULL;
    if (!match) continue;
    if (test_quick && tests[t].slow) { skipped++; continue; }
    test_failed_flag = test_skipped_flag = 0;
    rng_state = seed ^ hash_str(tests[t].name);
    test_sample_offset = test_sample > 1 ? (unsigned)(rng_state % test_sample) : 0;
    test_current_name = tests[t].name;
    printf("[ RUN  ] %s\n", tests[t].name);
    fflush(stdout);
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    tests[t].fn();
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double secs = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    if (test_failed_flag) {
      failed++;
      printf("[ FAIL ] %s (seed %llu; reproduce: %s --seed %llu%s%s %s)\n", tests[t].name, (unsigned long long)seed,
             argv[0], (unsigned long long)seed, test_quick ? " --quick" : "", sample_arg, tests[t].name);
    }
    else if (test_skipped_flag) { skipped++; printf("[ SKIP ] %s\n", tests[t].name); }
    else { passed++; printf("[  OK  ] %s (%.2f s)\n", tests[t].name, secs); }
    fflush(stdout);
  }
  printf("%d passed, %d failed, %d skipped (seed %llu)\n", passed, failed, skipped, (unsigned long long)seed);
  if (failed)
    printf("reproduce: %s --seed %llu%s%s (or KVATTN_TEST_SEED=%llu)\n", argv[0], (unsigned long long)seed,
           test_quick ? " --quick" : "", sample_arg, (unsigned long long)seed);
  return failed ? 1 : 0;
}
