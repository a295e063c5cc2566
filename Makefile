# SPDX-License-Identifier: Apache-2.0
# The two commands (README.md):
#   make run    the main job on bundled data
#   make test   the whole test suite: gcc -Werror build + CTest, then a clang
#               ASan+UBSan build with libFuzzer targets + CTest
# Both install missing Debian packages first (.ci/deps) and build.
BUILD ?= build
SAN_BUILD ?= build-san
TSAN_BUILD ?= build-tsan
JOBS ?= $(shell nproc 2>/dev/null || echo 2)
CMAKE_COMMON := -DKVP_WERROR=ON -DKVP_SHARED_DIR=$(abspath ../shared)

.PHONY: run test deps build test-main test-san test-tsan clean

deps:
	@.ci/deps

build: deps
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_C_COMPILER=gcc $(CMAKE_COMMON)
	cmake --build $(BUILD) -j $(JOBS)

# The main job: kvplane-bench replays the bundled Mooncake trace and agentic
# sessions with every policy (README "kvplane-bench").
run: build
	$(BUILD)/bench/kvplane-bench run --config bench/configs/default.yaml \
	  --out $(BUILD)/bench-report \
	  $(abspath ../shared)/traces/mooncake_conversation.jsonl.zst \
	  $(abspath ../shared)/traces/cc_agentic

test-main: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS)

test-san: deps
	cmake -S . -B $(SAN_BUILD) -DCMAKE_BUILD_TYPE=Debug -DCMAKE_C_COMPILER=clang \
	  -DKVP_SANITIZE=address,undefined -DKVP_FUZZ=ON $(CMAKE_COMMON)
	cmake --build $(SAN_BUILD) -j $(JOBS)
	cd $(SAN_BUILD) && ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 \
	  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	  ctest --output-on-failure -j $(JOBS)

# ThreadSanitizer: only the tests labelled tsan (target kvp_tsan_tests).
test-tsan: deps
	cmake -S . -B $(TSAN_BUILD) -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_C_COMPILER=clang \
	  -DKVP_SANITIZE=thread $(CMAKE_COMMON)
	cmake --build $(TSAN_BUILD) -j $(JOBS) --target kvp_tsan_tests
	cd $(TSAN_BUILD) && TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1 \
	  ctest --output-on-failure -L tsan

test: test-main test-san test-tsan
	@echo "kvplane: all tests passed (gcc build, clang ASan+UBSan build, clang TSan build)"

clean:
	rm -rf $(BUILD) $(SAN_BUILD) $(TSAN_BUILD)
