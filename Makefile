# kvattn build. `make` builds the library, the CLI and the Python binding's
# shared library; `make test` sets up what the tests need and runs them;
# `make bench` runs the default benchmark suite checked against the oracle.
CC       ?= cc
NVCC     ?= $(shell command -v nvcc 2>/dev/null || ls /usr/local/cuda/bin/nvcc 2>/dev/null)
PREFIX   ?= /usr/local
BUILD    ?= build
OPT      ?= -O3
WARN      = -Wall -Wextra -Werror -Wno-unknown-pragmas
CFLAGS_BASE = -DKVA_BUILD_COMPILER="\"$(notdir $(CC)) $(shell $(CC) -dumpversion)\"" -std=c11 -D_GNU_SOURCE $(OPT) -g $(WARN) -fPIC -fopenmp-simd -ffp-contract=fast -Iinclude -Isrc -pthread
LDLIBS    = -lm -pthread

# Sources by layer. Kernel bodies under src/cpu/simd/ are compiled once per
# SIMD level (portable, avx2, avxvnni, avx512) and chosen at run time.
CORE_SRC  = $(wildcard src/core/*.c) $(wildcard src/api/*.c) $(wildcard src/ref/*.c) $(wildcard src/cpu/*.c) $(wildcard src/paged/*.c)
SIMD_SRC  = $(wildcard src/cpu/simd/*.c)
CUDA_SRC  = $(wildcard src/cuda/*.cu)
TOOL_SRC  = $(wildcard tools/*.c)
TOOL_CU   = $(wildcard tools/*.cu)
TEST_SRC  = $(wildcard tests/*.c)

# x86 targets build all four levels (picked at run time by cpuid); other
# targets (aarch64: Grace, Graviton, ...) the portable level, whose fused
# kernel runs on generic vectors (NEON there). src/cpu/attend.c follows the
# compiler's target macros the same way.
KVA_ARCH := $(shell $(CC) -dumpmachine)
ifneq ($(filter x86_64% i386% i486% i586% i686%,$(KVA_ARCH)),)
SIMD_LEVELS = portable avx2 avxvnni avx512
else
SIMD_LEVELS = portable
endif
# The sanitizer and fuzz builds (test binaries run on the host that builds
# them) compile only the x86 levels its CPU runs, by /proc/cpuinfo's flags
# (every level where that cannot be read); the library and the optimized
# binaries always build all four.
HOST_CPU_FLAGS := $(if $(filter avx2,$(SIMD_LEVELS)),$(shell grep -m1 '^flags' /proc/cpuinfo 2>/dev/null))
has_cpu = $(if $(strip $(foreach f,$(1),$(if $(filter $(f),$(HOST_CPU_FLAGS)),,n))),,y)
ifneq ($(HOST_CPU_FLAGS),)
SAN_LEVELS = portable $(if $(call has_cpu,avx2 fma f16c bmi2),avx2 $(if $(call has_cpu,avx_vnni),avxvnni) \
  $(if $(call has_cpu,avx512f avx512dq avx512bw avx512vl avx512_vnni avx512_bf16),avx512))
else
SAN_LEVELS = $(SIMD_LEVELS)
endif
SAN_DEFS = $(foreach l,$(filter-out $(SAN_LEVELS),$(SIMD_LEVELS)),-DKVA_NO_SIMD_$(l))
SIMD_FLAGS_portable =
SIMD_FLAGS_avx2     = -mavx2 -mfma -mf16c -mbmi2
SIMD_FLAGS_avxvnni  = -mavx2 -mfma -mf16c -mbmi2 -mavxvnni
SIMD_FLAGS_avx512   = -mavx2 -mfma -mf16c -mbmi2 -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512bf16 -mavx512vnni -mamx-tile -mamx-bf16

ifneq ($(NVCC),)
HAVE_CUDA = 1
CUDA_HOME ?= $(patsubst %/bin/nvcc,%,$(NVCC))
CUDA_ARCH ?= -gencode=arch=compute_90a,code=sm_90a -gencode=arch=compute_80,code=compute_80
NVCCFLAGS = -O3 -std=c++17 $(CUDA_ARCH) -Xcompiler -fPIC,-Wall -Iinclude -Isrc -lineinfo --expt-relaxed-constexpr
comma := ,
# what the build info reports: the code= targets of CUDA_ARCH (sm_90a, compute_80 = PTX)
CUDA_CODES = $(subst $(eval) ,+,$(strip $(foreach c,$(subst $(comma), ,$(CUDA_ARCH)),$(patsubst code=%,%,$(filter code=%,$(c))))))
CFLAGS_BASE += -DKVA_HAVE_CUDA=1 -DKVA_CUDA_CODES="\"$(CUDA_CODES)\"" -I$(CUDA_HOME)/include
LDLIBS += -L$(CUDA_HOME)/lib64 -Wl,-rpath,$(CUDA_HOME)/lib64 -lcudart -lstdc++
endif

# NCCL (kva_cp_attention, context parallelism over GPUs), with CUDA only:
# nccl.h under NCCL_HOME (default: the CUDA toolkit, /usr/local or /usr; for
# PyPI's nvidia-nccl-cu13 pass NCCL_HOME=<site-packages>/nvidia/nccl) and
# libnccl.so(.2) in its lib, lib64 or the system's library directories.
# NCCL=0 builds without it.
ifneq ($(HAVE_CUDA),)
ifneq ($(NCCL),0)
NCCL_HOME ?= $(firstword $(foreach d,$(CUDA_HOME) /usr/local /usr,$(if $(wildcard $(d)/include/nccl.h),$(d))))
NCCL_LIB := $(if $(NCCL_HOME),$(firstword $(wildcard $(foreach d,$(NCCL_HOME)/lib $(NCCL_HOME)/lib64 /usr/local/lib /usr/lib/x86_64-linux-gnu /usr/lib64,$(d)/libnccl.so $(d)/libnccl.so.2))))
ifneq ($(NCCL_LIB),)
HAVE_NCCL = 1
CFLAGS_BASE += -DKVA_HAVE_NCCL=1 -I$(NCCL_HOME)/include
LDLIBS += -L$(dir $(NCCL_LIB)) -Wl,-rpath,$(dir $(NCCL_LIB)) -l:$(notdir $(NCCL_LIB))
endif
endif
endif

# objdir, SIMD levels
define objs
$(patsubst %.c,$(1)/%.o,$(CORE_SRC)) \
$(foreach l,$(2),$(patsubst %.c,$(1)/%.$(l).o,$(SIMD_SRC))) \
$(if $(HAVE_CUDA),$(patsubst %.cu,$(BUILD)/%.cu.o,$(CUDA_SRC)))
endef

LIB_OBJS = $(call objs,$(BUILD),$(SIMD_LEVELS))
ASAN_DIR = $(BUILD)/asan
ASAN_FLAGS = -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined
ASAN_OBJS = $(call objs,$(ASAN_DIR),$(SAN_LEVELS))
# ThreadSanitizer build (make test-tsan, CPU only).
TSAN_DIR = $(BUILD)/tsan
TSAN_FLAGS = -fsanitize=thread -fno-omit-frame-pointer
TSAN_OBJS = $(call objs,$(TSAN_DIR),$(SAN_LEVELS))

# The fuzz build (make fuzz, below): coverage everywhere, but no comparison
# tracing in the CPU kernels and their driver (half the run time, in loops
# whose comparisons are not the input's); clang's -O1 cannot vectorize some
# `omp simd` loops, which is a warning, not an error, there. (Set before the
# rules: the per-level rules expand these when they are defined.)
ifneq ($(FUZZ_BUILD),)
ASAN_FLAGS += -fsanitize=fuzzer-no-link
CFLAGS += -Wno-pass-failed
$(foreach l,$(SIMD_LEVELS),$(eval SIMD_FLAGS_$(l) += -fno-sanitize-coverage=trace-cmp))
$(ASAN_DIR)/src/cpu/%.o: CFLAGS += -fno-sanitize-coverage=trace-cmp
endif

.PHONY: all lib test test-c test-py test-tsan test-seeds test-asan test-aarch64 fuzz fuzz-regress bench bench-paged bench-cascade bench-rotation install clean format FORCE
# A failed recipe removes its half-written target, so the next run redoes it.
.DELETE_ON_ERROR:
all: $(BUILD)/libkvattn.a $(BUILD)/libkvattn.so $(BUILD)/kvattn $(BUILD)/kvattn_tests $(BUILD)/kvattn.pc
FORCE:

$(BUILD)/%.o: %.c $(wildcard include/*.h src/*/*.h src/cpu/simd/*.h tools/*.h tests/*.h)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_BASE) $(CFLAGS) -c $< -o $@
$(foreach l,$(SIMD_LEVELS),$(eval $(BUILD)/%.$(l).o: %.c $(wildcard include/*.h src/*/*.h src/cpu/simd/*.h) ; @mkdir -p $$(dir $$@) && $(CC) $(CFLAGS_BASE) $(CFLAGS) $(SIMD_FLAGS_$(l)) -DKVA_SIMD_LEVEL=$(l) -c $$< -o $$@))
$(BUILD)/%.cu.o: %.cu $(wildcard include/*.h src/*/*.h src/cuda/*.cuh tools/*.h)
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCCFLAGS) -c $< -o $@

$(ASAN_DIR)/%.o: %.c $(wildcard include/*.h src/*/*.h src/cpu/simd/*.h tools/*.h tests/*.h)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_BASE) -O1 $(ASAN_FLAGS) $(SAN_DEFS) $(CFLAGS) -c $< -o $@
$(foreach l,$(SIMD_LEVELS),$(eval $(ASAN_DIR)/%.$(l).o: %.c $(wildcard include/*.h src/*/*.h src/cpu/simd/*.h) ; @mkdir -p $$(dir $$@) && $(CC) $(CFLAGS_BASE) -O1 $(ASAN_FLAGS) $(SAN_DEFS) $(CFLAGS) $(SIMD_FLAGS_$(l)) -DKVA_SIMD_LEVEL=$(l) -c $$< -o $$@))

$(TSAN_DIR)/%.o: %.c $(wildcard include/*.h src/*/*.h src/cpu/simd/*.h tools/*.h tests/*.h)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_BASE) -O1 $(TSAN_FLAGS) $(SAN_DEFS) $(CFLAGS) -c $< -o $@
$(foreach l,$(SIMD_LEVELS),$(eval $(TSAN_DIR)/%.$(l).o: %.c $(wildcard include/*.h src/*/*.h src/cpu/simd/*.h) ; @mkdir -p $$(dir $$@) && $(CC) $(CFLAGS_BASE) -O1 $(TSAN_FLAGS) $(SAN_DEFS) $(CFLAGS) $(SIMD_FLAGS_$(l)) -DKVA_SIMD_LEVEL=$(l) -c $$< -o $$@))

# The level choice reaches the sanitizer builds' level table (attend.c)
# through a stamp rewritten only when it changes.
$(ASAN_DIR)/.levels $(TSAN_DIR)/.levels: FORCE
	@mkdir -p $(dir $@) && echo '$(SAN_LEVELS)' | cmp -s - $@ || echo '$(SAN_LEVELS)' > $@
$(ASAN_DIR)/src/cpu/attend.o: $(ASAN_DIR)/.levels
$(TSAN_DIR)/src/cpu/attend.o: $(TSAN_DIR)/.levels

$(BUILD)/libkvattn.a: $(LIB_OBJS)
	@rm -f $@
	ar rcs $@ $^
$(BUILD)/libkvattn.so: $(LIB_OBJS)
	$(CC) -shared -o $@ $^ $(LDLIBS)
$(BUILD)/kvattn: $(patsubst %.c,$(BUILD)/%.o,$(TOOL_SRC)) $(if $(HAVE_CUDA),$(patsubst %.cu,$(BUILD)/%.cu.o,$(TOOL_CU))) $(BUILD)/libkvattn.a
	$(CC) -o $@ $^ $(LDLIBS)
$(BUILD)/kvattn_tests: $(patsubst %.c,$(BUILD)/%.o,$(TEST_SRC)) $(BUILD)/libkvattn.a
	$(CC) -o $@ $^ $(LDLIBS)
$(ASAN_DIR)/kvattn_tests: $(patsubst %.c,$(ASAN_DIR)/%.o,$(TEST_SRC)) $(ASAN_OBJS)
	$(CC) $(ASAN_FLAGS) -o $@ $^ $(LDLIBS)
$(TSAN_DIR)/kvattn_tests: $(patsubst %.c,$(TSAN_DIR)/%.o,$(TEST_SRC)) $(TSAN_OBJS)
	$(CC) $(TSAN_FLAGS) -o $@ $^ $(LDLIBS)
$(BUILD)/kvattn.pc: FORCE # regenerated every time: it carries PREFIX
	@mkdir -p $(BUILD)
	@printf 'prefix=%s\nlibdir=$${prefix}/lib\nincludedir=$${prefix}/include\n\nName: kvattn\nDescription: fused attention over quantized/paged KV caches\nVersion: %s\nLibs: -L$${libdir} -lkvattn\nLibs.private: %s\nCflags: -I$${includedir}\n' \
	  '$(PREFIX)' "$$(sed -n 's/^#define KVA_VERSION_\(MAJOR\|MINOR\|PATCH\) \([0-9]*\)/\2/p' include/kvattn.h | paste -sd.)" '$(LDLIBS)' > $@

# ---- tests: C tests (optimized, then under ASan+UBSan), then Python tests
# The virtual environment is ready once its stamp exists, written last: a
# failed step (no network, pip error) leaves no stamp, and the next run
# starts it over instead of testing with half an environment.
VENV = .venv
PY   = $(VENV)/bin/python
VENV_OK = $(VENV)/.kvattn-ready
$(VENV_OK):
	rm -rf $(VENV)
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q numpy ml_dtypes pytest
	$(PY) -m pip install -q 'mlx[cpu]' || echo "mlx unavailable: MLX cross-check tests will be skipped"
	touch $@

test: check-layers
	$(MAKE) test-c
	$(MAKE) test-py
# Dependencies one way (docs/design.md, "Layers"): fails on an upward include.
.PHONY: check-layers
check-layers:
	sh tools/check_layers.sh
test-c: $(BUILD)/kvattn_tests $(ASAN_DIR)/kvattn_tests $(BUILD)/kvattn
	$(BUILD)/kvattn_tests
	$(BUILD)/kvattn bench --quick
	$(BUILD)/kvattn bench --quick --layout paged --block 16 --block-order sequential
	ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 $(ASAN_DIR)/kvattn_tests --quick
# The tests that call one context from several threads or run the thread
# pool over every path (quick tables), under ThreadSanitizer; CPU only. The
# fork tests are not among them: TSan does not support the child of a
# multi-threaded fork starting threads (they skip under TSan).
TSAN_TESTS = threads paged_attention_while_writing attention_cpu_vs_oracle \
             attention_caller_workspace block_table_vs_paged
test-tsan:
	$(MAKE) NVCC= $(TSAN_DIR)/kvattn_tests
	TSAN_OPTIONS=halt_on_error=1 $(TSAN_DIR)/kvattn_tests --quick $(TSAN_TESTS)

# The CPU oracle tests (--quick tables, random and probe queries) over
# SEEDS fresh seeds (each run draws its own and prints it); a failing run's
# seed and reproduction command are printed. `make test-seeds SEEDS=20`.
SEEDS ?= 100
SEED_TESTS = attention_cpu_vs_oracle attention_nan_inf attention_unseen_nan attention_masked_key_nan \
  attention_row_without_keys attention_sinks block_table_vs_paged block_table_caller_pools paged_attention_vs_oracle \
  paged_attention_after_state_ops cache_write_then_attend_block_table
test-seeds: $(BUILD)/kvattn_tests
	@pass=0; for i in $$(seq $(SEEDS)); do \
	  if $(BUILD)/kvattn_tests --quick $(SEED_TESTS) > $(BUILD)/test-seeds.log 2>&1; then pass=$$((pass + 1)); \
	  else grep -E "FAIL|reproduce" $(BUILD)/test-seeds.log; fi; \
	done; echo "test-seeds: $$pass of $(SEEDS) fresh seeds passed"; test $$pass -eq $(SEEDS)
# The Python suite at the best SIMD level, then, where that level is above
# avx2 (avxvnni, avx512), capped to avx2, whose kernels round differently:
# each test's allowance must follow the kernel that ran.
test-py: $(BUILD)/libkvattn.so $(BUILD)/kvattn $(VENV_OK)
	PYTHONPATH=python KVATTN_LIB=$(BUILD)/libkvattn.so $(PY) -m pytest -q python/tests
	@level=$$($(BUILD)/kvattn info | sed -n 's/^cpu simd: //p'); case "$$level" in \
	  avxvnni|avx512) echo "test-py: again capped to avx2 (best level here: $$level)"; \
	    KVATTN_SIMD=avx2 PYTHONPATH=python KVATTN_LIB=$(BUILD)/libkvattn.so $(PY) -m pytest -q python/tests ;; \
	  *) echo "test-py: best level here is $${level:-unknown}: no avx2-capped pass" ;; esac

# The full C test binary (not --quick) under ASan+UBSan: run it at least
# once per change to the kernels (about 4 minutes on 2 cores). ASAN_SAMPLE=N
# runs one case in N of the large oracle tables (the seed picks which; CI
# runs a quarter).
ASAN_SAMPLE ?= 1
test-asan: $(ASAN_DIR)/kvattn_tests
	ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 $(ASAN_DIR)/kvattn_tests --sample $(ASAN_SAMPLE)

# libFuzzer harness over the public API on a CPU context
# (tests/fuzz/fuzz_attention.c): the library and the harness built with
# clang under ASan+UBSan and coverage, CUDA left out, in $(FUZZ_DIR).
# `make fuzz` runs it for FUZZ_S seconds on the corpus in
# $(FUZZ_DIR)/corpus (seeded from tests/fuzz/regress, not committed) and
# prints the execution count; a crash input is written to $(FUZZ_DIR)/.
# `make fuzz-regress` replays the committed inputs of tests/fuzz/regress
# (crashes found and fixed) once each.
FUZZ_CC  ?= clang
FUZZ_S   ?= 60
FUZZ_DIR  = $(BUILD)/fuzz
FUZZ_BIN  = $(FUZZ_DIR)/asan/fuzz_attention
$(ASAN_DIR)/fuzz_attention: $(ASAN_DIR)/tests/fuzz/fuzz_attention.o $(ASAN_OBJS)
	$(CC) $(ASAN_FLAGS) -fsanitize=fuzzer -o $@ $^ $(LDLIBS)
$(FUZZ_BIN): FORCE
	$(MAKE) NVCC= CC=$(FUZZ_CC) BUILD=$(FUZZ_DIR) FUZZ_BUILD=1 $@

fuzz: $(FUZZ_BIN)
	@mkdir -p $(FUZZ_DIR)/corpus
	ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 $(FUZZ_BIN) -max_total_time=$(FUZZ_S) \
	  -print_final_stats=1 -artifact_prefix=$(FUZZ_DIR)/ $(FUZZ_DIR)/corpus tests/fuzz/regress
fuzz-regress: $(FUZZ_BIN)
	ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 $(FUZZ_BIN) -runs=1 tests/fuzz/regress/*

bench: $(BUILD)/kvattn
	$(BUILD)/kvattn bench
	@if $(TORCH_PY) -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' > /dev/null 2>&1; \
	then $(MAKE) bench-e2e; else echo "bench-e2e skipped: $(TORCH_PY) imports no torch with a CUDA device"; fi

# The end-to-end decode benchmark (bench/e2e_decode.py; bench/README.md):
# transformers models decoding over kvattn's packed caches against sdpa.
# In `make bench` only where TORCH_PY imports torch with a CUDA device;
# builds the torch extension first. Writes e2e_decode.{md,json,png} to E2E_OUT;
# E2E_ARGS passes options (e.g. E2E_ARGS="--models llama3-8b --ctx 32768").
E2E_OUT  ?= $(BUILD)/e2e
E2E_ARGS ?=
.PHONY: bench-e2e
bench-e2e: $(BUILD)/libkvattn_torch.so
	KVATTN_LIB=$(BUILD)/libkvattn.so KVATTN_TORCH_LIB=$(BUILD)/libkvattn_torch.so PYTHONPATH=python \
	  $(TORCH_PY) bench/e2e_decode.py --out $(E2E_OUT) $(E2E_ARGS)

# The aarch64 build (portable level, generic vectors on NEON), cross-compiled
# and run under qemu-user: the C tests (quick) and the oracle-checked bench
# smoke run (the fork tests skip there: qemu-user 7.2 aborts in the child of a
# multi-threaded fork). Needs Debian's gcc-aarch64-linux-gnu,
# libc6-dev-arm64-cross and qemu-user (.ci/run installs them).
CROSS_CC ?= aarch64-linux-gnu-gcc
QEMU     ?= qemu-aarch64 -L /usr/aarch64-linux-gnu
# One case in AARCH64_SAMPLE of the large oracle tables (the seed picks
# which; 1 runs them all): emulation is ~100x slower than native. The bench
# smoke run times one or two calls per case (times under emulation mean
# nothing; its oracle check is the point).
AARCH64_SAMPLE ?= 10
test-aarch64:
	$(MAKE) CC=$(CROSS_CC) NVCC= BUILD=$(BUILD)/aarch64 $(BUILD)/aarch64/kvattn_tests $(BUILD)/aarch64/kvattn
	KVATTN_TEST_EMULATED=qemu-user $(QEMU) $(BUILD)/aarch64/kvattn_tests --quick --sample $(AARCH64_SAMPLE)
	$(QEMU) $(BUILD)/aarch64/kvattn bench --quick --quiet --reps 1 --max-reps 2 --budget 0

# Paged vs contiguous (and a ragged batch) timed side by side in one run.
$(BUILD)/paged_vs_contiguous: bench/paged_vs_contiguous.c $(BUILD)/libkvattn.a
	$(CC) $(CFLAGS_BASE) -o $@ $< $(BUILD)/libkvattn.a $(LDLIBS)
bench-paged: $(BUILD)/paged_vs_contiguous
	$(BUILD)/paged_vs_contiguous

# Attention-output error of 4-bit keys with outlier channels, with and
# without the Hadamard rotation (CPU; the table of BENCHMARKS.md).
$(BUILD)/rotation_error: bench/rotation_error.c $(BUILD)/libkvattn.a
	$(CC) $(CFLAGS_BASE) -o $@ $< $(BUILD)/libkvattn.a $(LDLIBS)
bench-rotation: $(BUILD)/rotation_error
	$(BUILD)/rotation_error

# Cascade (shared prefix) vs one batched call, side by side, and the merge
# (CPU; CASCADE_ARGS="--backend cuda" for the GPU, see the program's usage).
$(BUILD)/cascade_vs_batched: bench/cascade_vs_batched.c $(BUILD)/libkvattn.a
	$(CC) $(CFLAGS_BASE) -o $@ $< $(BUILD)/libkvattn.a $(LDLIBS)
bench-cascade: $(BUILD)/cascade_vs_batched
	$(BUILD)/cascade_vs_batched $(CASCADE_ARGS)

# The PyTorch extension (optional, not part of `all` or `test`):
# torch.ops.kvattn.* in $(BUILD)/libkvattn_torch.so, linked to the
# libkvattn.so beside it (rpath $ORIGIN), compiled against the torch that
# TORCH_PY imports: PY when given (`make torch-ext PY=.venv-torch/bin/python`),
# else python3. CUDA tensors too when the library has CUDA and torch has.
# Fails with a message when that python has no torch.
TORCH_PY  ?= $(if $(filter command line environment,$(origin PY)),$(PY),python3)
CXX_TORCH ?= g++
TORCH_FLAGS = python/kvattn/csrc/torch_flags.py
.PHONY: torch-ext
torch-ext: $(BUILD)/libkvattn_torch.so
$(BUILD)/libkvattn_torch.so: python/kvattn/csrc/torch_ops.cpp $(TORCH_FLAGS) include/kvattn.h $(BUILD)/libkvattn.so
	@$(TORCH_PY) -c 'import torch' > /dev/null 2>&1 || { $(TORCH_PY) $(TORCH_FLAGS) cflags 0 x 2>&1 | tail -1 >&2; exit 1; }
	$(CXX_TORCH) -std=c++20 -O2 -g -fPIC -shared -Wall -Wextra -Iinclude \
	  $$($(TORCH_PY) $(TORCH_FLAGS) cflags $(if $(HAVE_CUDA),1,0) '$(CUDA_HOME)' 2>/dev/null) $< -o $@ -L$(BUILD) -lkvattn \
	  -Wl,-rpath,'$$ORIGIN' $$($(TORCH_PY) $(TORCH_FLAGS) libs $(if $(HAVE_CUDA),1,0) '$(CUDA_HOME)' 2>/dev/null)

install: $(BUILD)/libkvattn.a $(BUILD)/libkvattn.so $(BUILD)/kvattn $(BUILD)/kvattn.pc
	install -d $(DESTDIR)$(PREFIX)/lib/pkgconfig $(DESTDIR)$(PREFIX)/include $(DESTDIR)$(PREFIX)/bin
	install -m 644 include/kvattn.h $(DESTDIR)$(PREFIX)/include/
	install -m 644 $(BUILD)/libkvattn.a $(DESTDIR)$(PREFIX)/lib/
	install -m 755 $(BUILD)/libkvattn.so $(DESTDIR)$(PREFIX)/lib/
	install -m 755 $(BUILD)/kvattn $(DESTDIR)$(PREFIX)/bin/
	install -m 644 $(BUILD)/kvattn.pc $(DESTDIR)$(PREFIX)/lib/pkgconfig/

# Also what `pip install -e .` stages in the package (python/kvattn/_lib/) and
# `pip wheel . -w dist` / `python -m build` leave in dist/.
clean:
	rm -rf $(BUILD) python/kvattn/_lib dist
