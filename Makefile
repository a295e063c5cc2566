# SPDX-License-Identifier: Apache-2.0
# The two commands (README.md):
#   make run    the main job on bundled data: a Release build of kvplane-bench
#               alone (in $(RUN_BUILD)), then the replay; no developer checks
#   (and make live: the bundled traces through real peer routers in front of
#   emulated vLLM workers, beside kvplane's prediction; docs/live.md)
#   make test   the whole test suite: gcc -Werror build + CTest, then a clang
#               ASan+UBSan build with libFuzzer targets + CTest
# Both install missing Debian packages first (.ci/deps; `run` only what it
# builds) and build.
BUILD ?= build
RUN_BUILD ?= build-run
SAN_BUILD ?= build-san
TSAN_BUILD ?= build-tsan
JOBS ?= $(shell nproc 2>/dev/null || echo 2)
CMAKE_COMMON := -DKVP_WERROR=ON -DKVP_SHARED_DIR=$(abspath ../shared)

.PHONY: run live test deps deps-run build build-run test-main test-san test-tsan clean

deps:
	@.ci/deps

deps-run:
	@.ci/deps run

build: deps
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_C_COMPILER=gcc $(CMAKE_COMMON)
	cmake --build $(BUILD) -j $(JOBS)

# The main job builds what it runs: kvplane-bench alone, Release, without
# tests, warnings-as-errors or GPU kernels (the simulator needs none).
build-run: deps-run
	cmake -S . -B $(RUN_BUILD) -DCMAKE_BUILD_TYPE=Release -DCMAKE_C_COMPILER=gcc \
	  -DKVP_BUILD_TESTS=OFF -DKVP_WITH_CUDA=OFF -DKVP_WITH_HIP=OFF \
	  -DKVP_SHARED_DIR=$(abspath ../shared)
	cmake --build $(RUN_BUILD) -j $(JOBS) --target kvplane_bench

# The main job: kvplane-bench replays the bundled Mooncake trace and agentic
# sessions with every policy (README "kvplane-bench").
run: build-run
	$(RUN_BUILD)/bench/kvplane-bench run --config bench/configs/default.yaml \
	  --out $(RUN_BUILD)/bench-report \
	  $(abspath ../shared)/traces/mooncake_conversation.jsonl.zst \
	  $(abspath ../shared)/traces/cc_agentic

# The bundled traces live: a fresh emulated cluster (kvplane-bench engine) per
# row, replayed (kvplane-bench live) direct and through vllm-router 0.1.17
# (kv_aware, cache_aware) and sglang-router 0.3.2 (cache_aware), pinned in the
# git-ignored .venv-peers (installed when missing; skipped without PyPI), beside
# the offline prediction (kvplane-bench run); one table, with CSV/JSON, in
# $(LIVE_OUT), with kvplane-routerd's row (built here; needs libnats, which
# `deps` installs) as the reference.  LIVE_ARGS: bench/live/make_live.py
# --help (--time-scale, --workers, --traces, --limit).  ~5 min on 2 cores.
# ENGINE=vllm: the same rows on REAL vLLM workers (vLLM's CPU build in the
# per-user ~/.cache/kvplane/venv-vllm-*, installed when missing; a tiny model built here;
# each worker in its own CPU cgroup), the traces scaled to them and the
# offline prediction calibrated on them (docs/live.md).  ~30 min on 2 cores.
ENGINE ?= emulated
LIVE_OUT ?= $(RUN_BUILD)/live-report$(if $(filter vllm,$(ENGINE)),-vllm)
LIVE_ARGS ?=
live: deps build-run
	cmake --build $(RUN_BUILD) -j $(JOBS) --target kvplane_routerd
	python3 bench/live/make_live.py --bench $(RUN_BUILD)/bench/kvplane-bench \
	  --routerd $(RUN_BUILD)/connectors/kvplane-routerd \
	  --venv $(CURDIR)/.venv-peers --engine $(ENGINE) --out $(LIVE_OUT) $(LIVE_ARGS)

# KVP_BENCH_JOBS=1: kvplane-bench runs its simulations one at a time inside the
# tests (ctest already runs $(JOBS) tests at once; tests that check timing stay
# undisturbed); test_bench_cli and test_bench_jobs pass --jobs themselves.
test-main: build
	cd $(BUILD) && KVP_BENCH_JOBS=1 ctest --output-on-failure -j $(JOBS)

# -O1, as clang's AddressSanitizer docs advise ("to get a reasonable
# performance"): at -O0 the simulator tests ran 16x slower than the gcc build
# (test_bench_sim 212 s vs 13 s; 62 s at -O1), a third of .ci/run.  Debug
# keeps assert() on.
test-san: deps
	cmake -S . -B $(SAN_BUILD) -DCMAKE_BUILD_TYPE=Debug -DCMAKE_C_FLAGS_DEBUG="-g -O1" \
	  -DCMAKE_C_COMPILER=clang -DKVP_SANITIZE=address,undefined -DKVP_FUZZ=ON $(CMAKE_COMMON)
	cmake --build $(SAN_BUILD) -j $(JOBS)
	cd $(SAN_BUILD) && ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 \
	  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 KVP_BENCH_JOBS=1 \
	  ctest --output-on-failure -j $(JOBS)

# ThreadSanitizer: only the tests labelled tsan (target kvp_tsan_tests).
test-tsan: deps
	cmake -S . -B $(TSAN_BUILD) -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_C_COMPILER=clang \
	  -DKVP_SANITIZE=thread $(CMAKE_COMMON)
	cmake --build $(TSAN_BUILD) -j $(JOBS) --target kvp_tsan_tests
	cd $(TSAN_BUILD) && TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1 KVP_BENCH_JOBS=1 \
	  ctest --output-on-failure -L tsan

test: test-main test-san test-tsan
	@echo "kvplane: all tests passed (gcc build, clang ASan+UBSan build, clang TSan build)"

clean:
	rm -rf $(BUILD) $(RUN_BUILD) $(SAN_BUILD) $(TSAN_BUILD)
