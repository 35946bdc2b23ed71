/* Status codes, their messages (one X-macro list in kvattn.h) and the
 * thread-local message of the last error. */
#include "internal.h"

#include <stdarg.h>
#include <stdio.h>

static _Thread_local char last_error[512];

const char *kva_strerror(int status) {
  switch (status) {
#define KVA_X_CASE(name, value, msg) case value: return msg;
    KVA_STATUS_LIST(KVA_X_CASE)
#undef KVA_X_CASE
  default: return "unknown error";
  }
}

const char *kva_last_error(void) { return last_error; }

void kva_clearerr(void) { last_error[0] = '\0'; }

int kva_seterr(int status, const char *fmt, ...) {
  int n = snprintf(last_error, sizeof last_error, "%s: ", kva_strerror(status));
  if (n < 0) n = 0;
  if ((size_t)n < sizeof last_error) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_error + n, sizeof last_error - (size_t)n, fmt, ap);
    va_end(ap);
  }
  return status;
}

const char *kva_version(void) {
#define KVA_STR2(x) #x
#define KVA_STR(x) KVA_STR2(x)
  return KVA_STR(KVA_VERSION_MAJOR) "." KVA_STR(KVA_VERSION_MINOR) "." KVA_STR(KVA_VERSION_PATCH);
}
