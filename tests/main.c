/* Runs every registered test: kvattn_tests [--quick] [--seed S] [--list] [filter...]
 * (a filter selects the tests whose names contain it; "=name" the one test
 * of that name). Each run draws a fresh seed (time, pid, /dev/urandom) and prints it;
 * --seed S or the environment variable KVATTN_TEST_SEED replays one. */
#include "test.h"

#include <time.h>
#include <unistd.h>

#define MAX_TESTS 512
static struct { const char *name; test_fn fn; bool slow; } tests[MAX_TESTS];
static int ntests;
int test_failed_flag, test_skipped_flag;
bool test_quick;
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
    for (int f = 0; f < nf; ++f)
      match |= filters[f][0] == '=' ? !strcmp(tests[t].name, filters[f] + 1) : strstr(tests[t].name, filters[f]) != NULL;
    if (!match) continue;
    if (test_quick && tests[t].slow) { skipped++; continue; }
    test_failed_flag = test_skipped_flag = 0;
    rng_state = seed ^ hash_str(tests[t].name);
    test_current_name = tests[t].name;
    printf("[ RUN  ] %s\n", tests[t].name);
    fflush(stdout);
    tests[t].fn();
    if (test_failed_flag) {
      failed++;
      printf("[ FAIL ] %s (seed %llu; reproduce: %s --seed %llu%s %s)\n", tests[t].name, (unsigned long long)seed,
             argv[0], (unsigned long long)seed, test_quick ? " --quick" : "", tests[t].name);
    }
    else if (test_skipped_flag) { skipped++; printf("[ SKIP ] %s\n", tests[t].name); }
    else { passed++; printf("[  OK  ] %s\n", tests[t].name); }
    fflush(stdout);
  }
  printf("%d passed, %d failed, %d skipped (seed %llu)\n", passed, failed, skipped, (unsigned long long)seed);
  if (failed)
    printf("reproduce: %s --seed %llu%s (or KVATTN_TEST_SEED=%llu)\n", argv[0], (unsigned long long)seed,
           test_quick ? " --quick" : "", (unsigned long long)seed);
  return failed ? 1 : 0;
}
