# zipcached — plain GNU make, out-of-tree into $(BUILD).
#   make          build everything into build/
#   make run      build and start zipcached in the foreground
#   make check    install missing packages, build, run every test
#   make bench    build and run the benchmarks
#   make asan     build into build/asan with ASan+UBSan and run the tests
#   make fuzz     libFuzzer over framing, decoding and dispatch (FUZZ_SECONDS=60)
#   make check-gpu / bench-gpu   the CUDA library's tests / benchmark, on a GPU machine
# `check` and `run` install their Debian packages first (see `deps`).

BUILD ?= build
CC ?= cc
OPT ?= -O2 -g
SANITIZE ?=
PREFIX ?= /usr/local
DESTDIR ?=
BINDIR ?= $(PREFIX)/bin
LIBDIR ?= $(PREFIX)/lib
INCLUDEDIR ?= $(PREFIX)/include
# `make install` puts the Python package where Debian's python3 looks for
# packages of this prefix (/usr/local/lib/python3.11/dist-packages for
# /usr/local), so `import zipcache` works with no pip; empty without it.
PYTHON ?= /usr/bin/python3
PYTHONDIR ?= $(shell $(PYTHON) -c 'import sys; print("$(LIBDIR)/python%d.%d/dist-packages" % sys.version_info[:2])' 2>/dev/null)

# The library's version is the program's (proto/version.h); its soname
# carries the major number.
VERSION := $(shell sed -n 's/^[#]define ZIPCACHE_VERSION "\(.*\)"$$/\1/p' proto/version.h)
SONAME = libzipcache.so.$(firstword $(subst ., ,$(VERSION)))

# -ffp-contract=off: the codec promises bit-identical output on every ISA,
# so the compiler must not fuse a*b+c into an FMA behind our back.
ZC_CFLAGS = -std=c11 -D_GNU_SOURCE -Wall -Wextra -Wshadow -Wstrict-prototypes \
	-Wmissing-prototypes -Wno-unused-parameter -fPIC -ffp-contract=off \
	-Iinclude -I$(BUILD)/gen -Iproto $(OPT) $(SANITIZE) $(CFLAGS) -MMD -MP
ZC_LDFLAGS = $(SANITIZE) $(LDFLAGS)

# What a plain `make` needs before it can start, each as KIND:THING:PACKAGE
# (cmd: a program on PATH, pc: a pkg-config module, file: a file); `deps`
# installs the packages. Without this check a fresh machine's first `make`
# dies on "protoc: No such file or directory" without saying what to do.
BUILD_NEEDS = cmd:protoc:protobuf-compiler cmd:protoc-gen-nanopb:nanopb \
	cmd:pkg-config:pkg-config file:/usr/include/pb.h:libnanopb-dev \
	pc:libuv:libuv1-dev pc:libmicrohttpd:libmicrohttpd-dev pc:libsystemd:libsystemd-dev \
	pc:libxxhash:libxxhash-dev pc:hiredis:libhiredis-dev
# Goals that install the packages first (or need none): no check for them;
# the `$(MAKE) ...` they start afterwards checks.
NO_NEEDS_GOALS = deps deps-build check run bench asan fuzz clean

ifneq ($(MAKECMDGOALS),)
SKIP_NEEDS = $(if $(filter-out $(NO_NEEDS_GOALS),$(MAKECMDGOALS)),,yes)
endif
ifeq ($(SKIP_NEEDS),)
MISSING_NEEDS := $(shell IFS=:; for need in $(BUILD_NEEDS); do \
	set -- $$need; kind=$$1; thing=$$2; package=$$3; \
	case $$kind in \
	(cmd) command -v $$thing >/dev/null 2>&1 ;; \
	(pc) pkg-config --exists $$thing 2>/dev/null ;; \
	(file) test -e $$thing ;; \
	esac || printf '%s (package %s); ' $$thing $$package; \
	done)
ifneq ($(MISSING_NEEDS),)
$(error not installed: $(MISSING_NEEDS)run `make deps` as root to install those Debian packages (`make check` and `make run` run it first))
endif
endif

# Lazily expanded: pkg-config is only asked once `deps` has installed it.
UV_LIBS = $(shell pkg-config --libs libuv)
CHECK_CFLAGS = $(shell pkg-config --cflags check)
CHECK_LIBS = $(shell pkg-config --libs check)
NANOPB_LIBS = -lprotobuf-nanopb
# The same archive by path, for the shared library: wherever the compiler
# finds it (/usr/lib/<multiarch>/ on Debian), so any architecture builds.
NANOPB_ARCHIVE = $(shell $(CC) -print-file-name=libprotobuf-nanopb.a)
SERVER_LIBS = $(shell pkg-config --libs libmicrohttpd libsystemd hiredis)

# What `make` needs (the packages of BUILD_NEEDS and a compiler), then what
# the tests add; `make deps` installs both, `make deps-build` (an image's
# build stage) the first.
BUILD_PACKAGES = gcc libc6-dev make $(foreach need,$(BUILD_NEEDS),$(lastword $(subst :, ,$(need))))
DEPS_PACKAGES = $(BUILD_PACKAGES) python3-protobuf check python3-numpy python3-pytest prometheus \
	python3-yaml python3-torch redis-server redis-tools

AVX2_FLAGS = -mavx2 -mfma -mf16c -mbmi -mbmi2
AVX512_FLAGS = -mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma -mf16c -mbmi -mbmi2

CODEC_SRC = $(wildcard codec/*.c)
PROTO_SRC = $(wildcard proto/*.c)
CLIENT_SRC = $(wildcard client/*.c)
SERVER_SRC = $(filter-out server/main.c,$(wildcard server/*.c))
# A program in tools/ is tools/NAME.c with a main(); the other files there
# (npy.c, table.c, ...) are shared by the programs.
TOOL_MAINS = $(wildcard tools/zipcache-tool.c tools/zipcachectl.c tools/zipcache-load.c)
TOOL_NAMES = $(patsubst tools/%.c,%,$(TOOL_MAINS))
TOOL_LIB_SRC = $(filter-out $(TOOL_MAINS),$(wildcard tools/*.c))
TEST_NAMES = $(patsubst tests/%_test.c,%,$(wildcard tests/*_test.c))
# cuda_emulator.c needs cuda/plan.o: only the CUDA suites link it (below).
TEST_LIB_SRC = $(filter-out %_test.c tests/cuda_emulator.c,$(wildcard tests/*.c))
# cuda_bench and cuda_session_bench need CUDA: built with the CUDA library,
# run by `make bench-gpu`.
BENCH_NAMES = $(filter-out cuda cuda_session,$(patsubst bench/%_bench.c,%,$(wildcard bench/*_bench.c)))
BENCH_LIB_SRC = $(filter-out %_bench.c,$(wildcard bench/*.c))
EXAMPLE_NAMES = $(patsubst examples/%.c,%,$(wildcard examples/*.c))

PROTO_GEN_C = $(BUILD)/gen/zipcache.pb.c
PROTO_GEN_H = $(BUILD)/gen/zipcache.pb.h

obj = $(patsubst %.c,$(BUILD)/obj/%.o,$(1))
LIB_OBJ = $(call obj,$(CODEC_SRC) $(PROTO_SRC) $(CLIENT_SRC)) $(BUILD)/obj/gen/zipcache.pb.o
SERVER_OBJ = $(call obj,$(SERVER_SRC))
TOOL_LIB_OBJ = $(call obj,$(TOOL_LIB_SRC))
TEST_LIB_OBJ = $(call obj,$(TEST_LIB_SRC))
BENCH_LIB_OBJ = $(call obj,$(BENCH_LIB_SRC))

STATIC_LIB = $(BUILD)/lib/libzipcache.a
SHARED_LIB = $(BUILD)/lib/libzipcache.so
SERVER_LIB = $(BUILD)/lib/libzipcached.a
DAEMON = $(if $(wildcard server/main.c),$(BUILD)/bin/zipcached)
TOOLS = $(addprefix $(BUILD)/bin/,$(TOOL_NAMES))
TESTS = $(addprefix $(BUILD)/tests/,$(TEST_NAMES))
BENCHES = $(addprefix $(BUILD)/bench/,$(BENCH_NAMES))
EXAMPLES = $(addprefix $(BUILD)/bin/,$(EXAMPLE_NAMES))

# ---- CUDA: libzipcache_cuda.so, only where nvcc is (never required) ----
# nvcc from PATH, else CUDA's default prefix; none: nothing of this is
# built and `make check` says so in one line. Machine code for Ampere and
# Hopper plus PTX for later chips.
NVCC ?= $(firstword $(shell command -v nvcc 2>/dev/null) $(wildcard /usr/local/cuda/bin/nvcc))
CUDA_HOME ?= $(patsubst %/bin/nvcc,%,$(NVCC))
CUDA_ARCH ?= -gencode=arch=compute_80,code=sm_80 -gencode=arch=compute_90,code=[sm_90,compute_90]
CUDA_LIB = $(BUILD)/lib/libzipcache_cuda.so
CUDA_SONAME = libzipcache_cuda.so.$(firstword $(subst ., ,$(VERSION)))
CUDA_OBJ = $(BUILD)/obj/cuda/cuda.o $(BUILD)/obj/cuda/plan.o $(BUILD)/obj/cuda/session.o \
	$(BUILD)/obj/cuda/kernels.o
# The runtime linked in statically: the library needs only the driver.
CUDA_LIBS = -L$(CUDA_HOME)/lib64 -lcudart_static -lstdc++ -ldl -lrt -lpthread
# Against the shared client library by its soname, found beside the
# library (and from build/tests/gpu, build/bench), wherever the tree is.
SHARED_LINK = -L$(BUILD)/lib -l:libzipcache.so -Wl,-rpath,'$$ORIGIN' -Wl,-rpath,'$$ORIGIN/../lib' \
	-Wl,-rpath,'$$ORIGIN/../../lib'
GPU_TESTS = $(if $(NVCC),$(BUILD)/tests/gpu/cuda_test)
CUDA_BENCH = $(if $(NVCC),$(BUILD)/bench/cuda_bench)
CUDA_SESSION_BENCH = $(if $(NVCC),$(BUILD)/bench/cuda_session_bench)
CUDA_ALL = $(if $(NVCC),$(CUDA_LIB) $(BUILD)/lib/$(CUDA_SONAME) $(GPU_TESTS) $(CUDA_BENCH) \
	$(CUDA_SESSION_BENCH))

.PHONY: all deps deps-build check check-run check-no-rebuild check-gpu bench-gpu bench bench-run asan run install clean
.DEFAULT_GOAL := all
# Keep objects make considers intermediate, so a second `make` relinks nothing.
.SECONDARY:

all: $(STATIC_LIB) $(SHARED_LIB) $(DAEMON) $(TOOLS) $(EXAMPLES) $(CUDA_ALL)

# Only what is missing, without Recommends, and no service left enabled or
# running by the install (build-aux/deps.sh says how).
deps:
	@sh build-aux/deps.sh $(DEPS_PACKAGES)

deps-build:
	@sh build-aux/deps.sh $(BUILD_PACKAGES)

# Generated protobuf code is a build output (never committed). One protoc
# run writes both files: a grouped target (&:), so make runs it once. With
# a plain two-target rule make runs it again for the second file (its
# cached listing of build/gen predates the first run), the header gets a
# newer mtime than the objects built in between, and the next `make`
# recompiles and relinks them.
$(PROTO_GEN_C) $(PROTO_GEN_H) &: proto/zipcache.proto proto/zipcache.options
	@mkdir -p $(BUILD)/gen
	protoc --plugin=protoc-gen-nanopb=/usr/bin/protoc-gen-nanopb -Iproto \
		--nanopb_out=-fproto/zipcache.options:$(BUILD)/gen proto/zipcache.proto

$(BUILD)/obj/gen/zipcache.pb.o: $(PROTO_GEN_C)
	@mkdir -p $(dir $@)
	$(CC) $(ZC_CFLAGS) -c $< -o $@

# Every object may include the generated header, so it comes first.
$(BUILD)/obj/%.o: %.c | $(PROTO_GEN_H)
	@mkdir -p $(dir $@)
	$(CC) $(ZC_CFLAGS) $(EXTRA_CFLAGS) -c $< -o $@

$(BUILD)/obj/codec/kernels_avx2.o $(BUILD)/obj/codec/attend_avx2.o: EXTRA_CFLAGS = $(AVX2_FLAGS)
$(BUILD)/obj/codec/kernels_avx512.o $(BUILD)/obj/codec/attend_avx512.o: EXTRA_CFLAGS = $(AVX512_FLAGS)
$(BUILD)/obj/tests/%.o: EXTRA_CFLAGS = $(CHECK_CFLAGS) -DZC_BUILD_DIR='"$(abspath $(BUILD))"'
$(BUILD)/obj/bench/%.o: EXTRA_CFLAGS = -DZC_BUILD_DIR='"$(abspath $(BUILD))"'

$(STATIC_LIB): $(LIB_OBJ)
	@mkdir -p $(dir $@)
	rm -f $@ && ar rcs $@ $^

# The shared library carries its own copy of the nanopb runtime, so users
# link only -lzipcache.
$(SHARED_LIB): $(LIB_OBJ) client/libzipcache.map
	@mkdir -p $(dir $@)
	$(CC) -shared -Wl,-soname,$(SONAME) -Wl,--version-script=client/libzipcache.map -o $@ $(LIB_OBJ) \
		-Wl,--whole-archive $(NANOPB_ARCHIVE) \
		-Wl,--no-whole-archive -lm $(ZC_LDFLAGS)

$(SERVER_LIB): $(SERVER_OBJ)
	@mkdir -p $(dir $@)
	rm -f $@ && ar rcs $@ $^

LINK_ALL = $(SERVER_LIB) $(TOOL_LIB_OBJ) $(STATIC_LIB)
LINK_LIBS = $(NANOPB_LIBS) $(SERVER_LIBS) $(UV_LIBS) -lm -lpthread

$(DAEMON): $(BUILD)/obj/server/main.o $(SERVER_LIB) $(STATIC_LIB)
	@mkdir -p $(dir $@)
	$(CC) -o $@ $^ $(LINK_LIBS) $(ZC_LDFLAGS)

$(BUILD)/bin/%: $(BUILD)/obj/tools/%.o $(TOOL_LIB_OBJ) $(STATIC_LIB)
	@mkdir -p $(dir $@)
	$(CC) -o $@ $^ $(LINK_LIBS) $(ZC_LDFLAGS)

$(BUILD)/bin/%: $(BUILD)/obj/examples/%.o $(STATIC_LIB)
	@mkdir -p $(dir $@)
	$(CC) -o $@ $^ $(LINK_LIBS) $(ZC_LDFLAGS)

$(BUILD)/tests/%: $(BUILD)/obj/tests/%_test.o $(TEST_LIB_OBJ) $(LINK_ALL)
	@mkdir -p $(dir $@)
	$(CC) -o $@ $^ $(CHECK_LIBS) $(LINK_LIBS) $(ZC_LDFLAGS)

$(BUILD)/bench/%: $(BUILD)/obj/bench/%_bench.o $(BENCH_LIB_OBJ) $(LINK_ALL)
	@mkdir -p $(dir $@)
	$(CC) -o $@ $^ $(LINK_LIBS) $(ZC_LDFLAGS)

# CUDA (variables above): the library, its GPU suite and benchmark.
$(BUILD)/lib/$(SONAME): $(SHARED_LIB)
	ln -sfn libzipcache.so $@

$(BUILD)/lib/$(CUDA_SONAME): $(CUDA_LIB)
	ln -sfn libzipcache_cuda.so $@

$(BUILD)/obj/cuda/cuda.o $(BUILD)/obj/tests/gpu/cuda_test.o $(BUILD)/obj/bench/cuda_bench.o \
		$(BUILD)/obj/bench/cuda_session_bench.o: \
	EXTRA_CFLAGS += -I$(CUDA_HOME)/include
$(BUILD)/obj/tests/gpu/cuda_test.o: EXTRA_CFLAGS += $(CHECK_CFLAGS)

$(BUILD)/obj/cuda/kernels.o: cuda/kernels.cu cuda/core.h cuda/job.h cuda/kernels.h
	@mkdir -p $(dir $@)
	$(NVCC) $(CUDA_ARCH) -O3 -std=c++17 -Iinclude -Xcompiler -fPIC -c $< -o $@

$(CUDA_LIB): $(CUDA_OBJ) cuda/libzipcache_cuda.map $(SHARED_LIB) $(BUILD)/lib/$(SONAME)
	$(CC) -shared -Wl,-soname,$(CUDA_SONAME) -Wl,--version-script=cuda/libzipcache_cuda.map \
		-o $@ $(CUDA_OBJ) $(CUDA_LIBS) $(SHARED_LINK) $(ZC_LDFLAGS)

$(BUILD)/tests/gpu/cuda_test: $(BUILD)/obj/tests/gpu/cuda_test.o $(BUILD)/obj/tests/cuda_layers.o \
		$(BUILD)/obj/tests/suite_main.o $(CUDA_LIB) $(BUILD)/lib/$(CUDA_SONAME)
	@mkdir -p $(dir $@)
	$(CC) -o $@ $(filter %.o,$^) -L$(BUILD)/lib -l:libzipcache_cuda.so $(SHARED_LINK) \
		$(CUDA_LIBS) $(CHECK_LIBS) -lm $(ZC_LDFLAGS)

$(BUILD)/bench/cuda_bench: $(BUILD)/obj/bench/cuda_bench.o $(BUILD)/obj/bench/synthetic_kv.o $(CUDA_LIB) \
		$(BUILD)/lib/$(CUDA_SONAME)
	@mkdir -p $(dir $@)
	$(CC) -o $@ $(filter %.o,$^) -L$(BUILD)/lib -l:libzipcache_cuda.so $(SHARED_LINK) \
		$(CUDA_LIBS) -lm -lpthread $(ZC_LDFLAGS)

$(BUILD)/bench/cuda_session_bench: $(BUILD)/obj/bench/cuda_session_bench.o \
		$(BUILD)/obj/bench/synthetic_kv.o $(CUDA_LIB) $(BUILD)/lib/$(CUDA_SONAME)
	@mkdir -p $(dir $@)
	$(CC) -o $@ $(filter %.o,$^) -L$(BUILD)/lib -l:libzipcache_cuda.so $(SHARED_LINK) \
		$(CUDA_LIBS) -lm -lpthread $(ZC_LDFLAGS)

# The CPU half of the CUDA code (planning, a session's layer read and its
# mirror checks, and core.h's arithmetic under emulation) is tested
# everywhere, nvcc or not.
$(BUILD)/tests/cuda_plan: $(BUILD)/obj/cuda/plan.o $(BUILD)/obj/tests/cuda_emulator.o
$(BUILD)/tests/cuda_session: $(BUILD)/obj/cuda/plan.o $(BUILD)/obj/cuda/session.o \
	$(BUILD)/obj/tests/cuda_emulator.o

# On a machine with a GPU: bit identity, incremental loads, memcheck, and
# the Python GPU tests (torch, transformers generate()).
check-gpu: all
	@ZC_BUILD_DIR=$(abspath $(BUILD)) sh cuda/check-gpu.sh

# The GPU benchmark (docs/BENCHMARKS.md): JSON lines.
bench-gpu: all
	$(CUDA_BENCH) $(BENCH_GPU_ARGS)
	ZC_BUILD_DIR=$(abspath $(BUILD)) $(CUDA_SESSION_BENCH) $(BENCH_GPU_ARGS)

# Builds use every CPU (BUILD_JOBS); the suites then run one at a time
# (-j1: several at once would time each other out on a small machine).
BUILD_JOBS ?= $(shell nproc 2>/dev/null || echo 1)

check: deps
	@$(MAKE) --no-print-directory -j$(BUILD_JOBS) all $(TESTS)
	@$(MAKE) --no-print-directory -j1 check-run check-no-rebuild

# The Python client's pytest suite; not under sanitizers, whose runtime
# cannot load into an uninstrumented python3.
PYTHON_SUITES = $(if $(SANITIZE),,python/run_tests.sh)

# Each suite runs on its own; the summary line at the end is what CI reads.
check-run: all $(TESTS)
	@pass=0; fail=0; for t in $(TESTS) $(PYTHON_SUITES); do \
		echo "== $$t"; start=$$(date +%s); \
		if ZC_BUILD_DIR=$(abspath $(BUILD)) ZC_SOURCE_DIR=$(CURDIR) $$t; then pass=$$((pass+1)); \
		else fail=$$((fail+1)); echo "FAILED: $$t"; fi; \
		echo "-- $$t: $$(( $$(date +%s) - start )) s"; \
	done; \
	$(if $(NVCC),ZC_BUILD_DIR=$(abspath $(BUILD)) $(GPU_TESTS) --probe,echo "gpu: skipped: libzipcache_cuda.so and its tests were not built (no nvcc here, or a sanitized build)"); \
	echo "suites: $$pass passed, $$fail failed"; [ $$fail -eq 0 ]

# After a full build a second `make` must find nothing to do; -q asks
# make without building anything, so this can run right after the tests.
check-no-rebuild:
	@$(MAKE) --no-print-directory -q all $(TESTS) || { \
		echo "check-no-rebuild: a second make would rebuild something (make -d all says what)"; \
		exit 1; }

bench: deps
	@$(MAKE) --no-print-directory bench-run

bench-run: all $(BENCHES)
	@for b in $(BENCHES); do echo "== $$b"; ZC_BUILD_DIR=$(abspath $(BUILD)) $$b || exit 1; done

# The CUDA library is left out (NVCC=): no sanitizer instruments nvcc's
# code, and its suites need a GPU, which `make check-gpu` runs on.
ASAN_MAKE = $(MAKE) --no-print-directory BUILD=build/asan OPT='-O1 -g -fno-omit-frame-pointer' \
	SANITIZE='-fsanitize=address,undefined -fno-sanitize-recover=undefined' NVCC=

asan: deps
	@$(ASAN_MAKE) -j$(BUILD_JOBS) all $(TESTS)
	@$(ASAN_MAKE) -j1 check-run check-no-rebuild

run: deps
	@$(MAKE) --no-print-directory all
	$(DAEMON) $(RUN_ARGS)

# The shared library goes in as libzipcache.so.VERSION with the soname
# link (what programs load) and the development link (what -lzipcache
# finds); ldconfig then puts it in the loader's cache. The .pc file is
# written here, not at build time, so it names the PREFIX of the install.
install: all
	install -d $(DESTDIR)$(BINDIR) $(DESTDIR)$(LIBDIR)/pkgconfig $(DESTDIR)$(INCLUDEDIR)/zipcache
	install -m 755 $(DAEMON) $(TOOLS) $(DESTDIR)$(BINDIR)
	install -m 644 $(STATIC_LIB) $(DESTDIR)$(LIBDIR)
	install -m 755 $(SHARED_LIB) $(DESTDIR)$(LIBDIR)/libzipcache.so.$(VERSION)
	ln -sfn libzipcache.so.$(VERSION) $(DESTDIR)$(LIBDIR)/$(SONAME)
	ln -sfn $(SONAME) $(DESTDIR)$(LIBDIR)/libzipcache.so
	$(if $(NVCC),install -m 755 $(CUDA_LIB) $(DESTDIR)$(LIBDIR)/libzipcache_cuda.so.$(VERSION))
	$(if $(NVCC),ln -sfn libzipcache_cuda.so.$(VERSION) $(DESTDIR)$(LIBDIR)/$(CUDA_SONAME))
	$(if $(NVCC),ln -sfn $(CUDA_SONAME) $(DESTDIR)$(LIBDIR)/libzipcache_cuda.so)
	printf '%s\n' 'prefix=$(PREFIX)' 'libdir=$(LIBDIR)' 'includedir=$(INCLUDEDIR)' '' \
		'Name: zipcache' 'Description: zipcached client library and codec' 'Version: $(VERSION)' \
		'Libs: -L$${libdir} -lzipcache' 'Libs.private: $(NANOPB_LIBS) -lm' 'Cflags: -I$${includedir}' \
		> $(DESTDIR)$(LIBDIR)/pkgconfig/zipcache.pc
	install -m 644 include/zipcache/*.h $(DESTDIR)$(INCLUDEDIR)/zipcache
	$(if $(PYTHONDIR),install -d $(DESTDIR)$(PYTHONDIR)/zipcache,@echo "install: no $(PYTHON): the Python package is not installed")
	$(if $(PYTHONDIR),install -m 644 python/zipcache/*.py $(DESTDIR)$(PYTHONDIR)/zipcache)
	@if [ -n "$(DESTDIR)" ]; then :; \
	elif [ "$$(id -u)" -ne 0 ]; then \
		echo "install: not root, so ldconfig did not run: programs find $(SONAME) only through LD_LIBRARY_PATH=$(LIBDIR) or -Wl,-rpath,$(LIBDIR)"; \
	else \
		echo ldconfig; ldconfig; \
		ldconfig -p | grep -qF '=> $(LIBDIR)/$(SONAME)' || \
		echo "install: $(LIBDIR) is not on the dynamic linker's path: add it to a file in /etc/ld.so.conf.d/ and run ldconfig (or link with -Wl,-rpath,$(LIBDIR))"; \
	fi

clean:
	rm -rf $(BUILD)


# ---- fuzzing: libFuzzer over framing, decoding and dispatch (fuzz/README.md) ----
#   make fuzz          run fuzz/dispatch_fuzz.c for FUZZ_SECONDS (default 60)
#   make fuzz-corpus   regenerate the committed seeds from fuzz/make_corpus.c
# Every object is rebuilt by clang with libFuzzer's coverage and ASan+UBSan
# into $(BUILD)/fuzz/obj; the nanopb runtime links as Debian built it.
FUZZ_CC ?= clang
FUZZ_SECONDS ?= 60
FUZZ_ARGS ?=
FUZZ_DEPS_PACKAGES = clang libclang-rt-14-dev
FUZZ_DIR = $(BUILD)/fuzz
FUZZ_TARGET = $(FUZZ_DIR)/dispatch_fuzz
FUZZ_SAN = -fsanitize=address,undefined -fno-sanitize-recover=undefined
FUZZ_CFLAGS = $(filter-out $(OPT) $(SANITIZE),$(ZC_CFLAGS)) -g -O1 -fno-omit-frame-pointer \
	$(FUZZ_SAN) -fsanitize=fuzzer-no-link
fuzz_obj = $(patsubst %.c,$(FUZZ_DIR)/obj/%.o,$(1))
FUZZ_OBJ = $(call fuzz_obj,fuzz/dispatch_fuzz.c $(CODEC_SRC) $(PROTO_SRC) $(CLIENT_SRC) $(SERVER_SRC)) \
	$(FUZZ_DIR)/obj/gen/zipcache.pb.o

.PHONY: fuzz fuzz-run fuzz-corpus

$(FUZZ_DIR)/obj/gen/zipcache.pb.o: $(PROTO_GEN_C)
	@mkdir -p $(dir $@)
	$(FUZZ_CC) $(FUZZ_CFLAGS) -c $< -o $@

$(FUZZ_DIR)/obj/%.o: %.c | $(PROTO_GEN_H)
	@mkdir -p $(dir $@)
	$(FUZZ_CC) $(FUZZ_CFLAGS) $(EXTRA_CFLAGS) -c $< -o $@

$(FUZZ_DIR)/obj/codec/kernels_avx2.o $(FUZZ_DIR)/obj/codec/attend_avx2.o: EXTRA_CFLAGS = $(AVX2_FLAGS)
$(FUZZ_DIR)/obj/codec/kernels_avx512.o $(FUZZ_DIR)/obj/codec/attend_avx512.o: EXTRA_CFLAGS = $(AVX512_FLAGS)
# The SIMD kernels are not what the fuzzer explores (tests/codec_test.c
# checks them against the reference), and clang spends many minutes on
# them under ASan: build them plainly.
$(FUZZ_DIR)/obj/codec/kernels_%.o $(FUZZ_DIR)/obj/codec/attend_avx%.o: FUZZ_CFLAGS = $(filter-out $(OPT) $(SANITIZE),$(ZC_CFLAGS)) -g -O2

$(FUZZ_TARGET): $(FUZZ_OBJ)
	$(FUZZ_CC) -fsanitize=fuzzer $(FUZZ_SAN) -o $@ $^ $(NANOPB_LIBS) $(SERVER_LIBS) $(UV_LIBS) -lm -lpthread

fuzz: deps
	@$(MAKE) --no-print-directory DEPS_PACKAGES='$(FUZZ_DEPS_PACKAGES)' deps
	@$(MAKE) --no-print-directory fuzz-run

# New inputs accumulate in $(FUZZ_DIR)/corpus (the seeds are copied in each
# run); fuzz/regressions is replayed first. Crash inputs land in
# $(FUZZ_DIR)/crashes and fail the target.
fuzz-run: $(FUZZ_TARGET)
	@mkdir -p $(FUZZ_DIR)/corpus $(FUZZ_DIR)/crashes
	@cp fuzz/corpus/* $(FUZZ_DIR)/corpus/
	$(FUZZ_TARGET) -max_total_time=$(FUZZ_SECONDS) -max_len=70000 -timeout=30 \
		-dict=fuzz/dispatch.dict -print_final_stats=1 \
		-artifact_prefix=$(abspath $(FUZZ_DIR)/crashes)/ $(FUZZ_ARGS) \
		$(FUZZ_DIR)/corpus fuzz/regressions

fuzz-corpus: $(BUILD)/obj/fuzz/make_corpus.o $(STATIC_LIB)
	@mkdir -p $(FUZZ_DIR)
	$(CC) -o $(FUZZ_DIR)/make_corpus $^ $(NANOPB_LIBS) -lm $(ZC_LDFLAGS)
	rm -rf fuzz/corpus && mkdir -p fuzz/corpus && $(FUZZ_DIR)/make_corpus fuzz/corpus

-include $(shell find $(FUZZ_DIR)/obj -name '*.d' 2>/dev/null)

-include $(shell find $(BUILD)/obj -name '*.d' 2>/dev/null)
