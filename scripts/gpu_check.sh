#!/usr/bin/env bash
# Every GPU path in one command, for a lent GPU machine (one H200, no network, no Rust
# registry): the binaries are built here, carried over with the working tree, and run there.
#
#   scripts/gpu_check.sh build          # here: release binaries, stripped, in the payload
#   scripts/gpu_check.sh build --dev    # the same in the dev profile (CI; quicker to build)
#   scripts/gpu_check.sh                # there (or here): run every check on the payload
#
# The payload is target/gpu_check_payload/ (ignored by git, so carry it: the device tool's
# `run` with carry=["target/gpu_check_payload"]): an xz tarball (stripped, the binaries are
# about 150 MiB; packed, about a sixth) of two binaries built with `--features cuda,wgpu`: `gpu_check` (the libraries, BERT and GPT against the CPU, a bf16
# BERT-large step's TFLOP/s, NCCL on one rank) and `kernels` (every CubeCL kernel against
# its reference). CUDA, NVRTC, NCCL and Vulkan are loaded at run time, so the binaries start
# anywhere; what the machine lacks is reported and skipped, the rest runs. One line per
# check: PASS, FAIL or SKIP, with the numbers. The exit status is 1 if anything failed.
set -uo pipefail
cd "$(dirname "$0")/.."
payload=${GPU_CHECK_PAYLOAD:-target/gpu_check_payload}
features=cuda,wgpu

build() {
  set -e
  local profile=release
  if [ "${1:-}" = "--dev" ]; then profile=dev; fi
  # One cargo invocation for both binaries, so that they share one feature resolution and
  # Burn is compiled once (two invocations compiled it twice: ~6 min in the dev profile).
  # The binaries' paths are in cargo's JSON messages.
  local messages
  messages=$(cargo build --profile "$profile" -p burn-megatron-examples -p burn-megatron-kernels \
    --features "$features" --example gpu_check --test kernels --message-format=json-render-diagnostics)
  local example kernels
  example=$(grep -o '"executable":"[^"]*/gpu_check[^"/]*"' <<<"$messages" | tail -1 | cut -d'"' -f4)
  kernels=$(grep -o '"executable":"[^"]*/kernels-[^"/]*"' <<<"$messages" | tail -1 | cut -d'"' -f4)
  [ -x "$example" ] || { echo "gpu_check: the gpu_check example was not built" >&2; exit 1; }
  [ -x "$kernels" ] || { echo "gpu_check: the kernel test binary was not built" >&2; exit 1; }
  local staging=target/gpu_check_staging
  rm -rf "$payload" "$staging" && mkdir -p "$payload" "$staging"
  cp "$example" "$staging/gpu_check"
  cp "$kernels" "$staging/kernels"
  strip "$staging/gpu_check" "$staging/kernels"
  echo "stripped: $(du -cb "$staging"/* | tail -1 | cut -f1) bytes"
  tar -C "$staging" -cf - gpu_check kernels | xz -T0 -6 >"$payload/payload.tar.xz"
  rm -rf "$staging"
  local bytes
  bytes=$(du -cb "$payload"/* | tail -1 | cut -f1)
  echo "payload: $payload, $((bytes / 1048576)) MiB ($profile profile):"
  ls -la "$payload"
  if ((bytes > 64 * 1048576)); then
    echo "gpu_check: the payload is over the 64 MiB a device run carries" >&2
    exit 1
  fi
  echo "carry it: run(command=\"scripts/gpu_check.sh\", carry=[\"$payload\"], timeout_s=600)"
}

# check NAME STATUS DETAIL: one report line (and the failure count).
failed=0
line() {
  echo "$1 $2: $3"
  if [ "$1" = FAIL ]; then failed=$((failed + 1)); fi
}

# Every step is bounded (60 + 2 × 120 + 300 s at most), so the whole run fits the device
# tool's 600 s.
run_checks() {
  # The Vulkan loader complains on every probe without one.
  if [ -z "${XDG_RUNTIME_DIR:-}" ]; then
    export XDG_RUNTIME_DIR=$(mktemp -d)
  fi
  [ -f "$payload/payload.tar.xz" ] ||
    { echo "gpu_check: no $payload/payload.tar.xz: run 'scripts/gpu_check.sh build' first" >&2; exit 2; }
  local bin=target/gpu_check_bin
  rm -rf "$bin" && mkdir -p "$bin"
  xz -dc "$payload/payload.tar.xz" | tar -C "$bin" -xf - ||
    { echo "gpu_check: the payload does not unpack" >&2; exit 2; }
  echo "== machine"
  nvidia-smi -L 2>/dev/null || echo "nvidia-smi: none"
  for lib in libcuda.so libnvrtc.so libnccl.so; do
    found=$(ldconfig -p 2>/dev/null | grep -m1 "$lib" | awk '{print $NF}')
    echo "$lib: ${found:-not on the loader path (LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-})}"
  done
  icds=$(ls /usr/share/vulkan/icd.d/*.json /etc/vulkan/icd.d/*.json 2>/dev/null | tr '\n' ' ')
  echo "Vulkan ICDs: ${icds:-none}"
  echo "payload: $(du -sh "$payload" | cut -f1) packed, $(du -sh "$bin" | cut -f1) unpacked"

  echo "== libraries and devices"
  devices=$(timeout 60 "$bin/gpu_check" libraries)
  echo "$devices"

  echo "== kernels"
  for dev in cuda wgpu; do
    name="kernels on $dev"
    if ! grep -q "^PASS device $dev:" <<<"$devices"; then
      line SKIP "$name" "$(grep "device $dev:" <<<"$devices" | cut -d: -f2- | sed 's/^ //')"
      continue
    fi
    kind=$dev
    [ "$dev" = wgpu ] && kind=wgpu-gpu
    start=$SECONDS
    out=$(KERNEL_TEST_DEVICE=$kind timeout 120 "$bin/kernels" on_cube 2>&1)
    status=$?
    result=$(grep -m1 "^test result" <<<"$out")
    if [ $status -eq 0 ]; then
      line PASS "$name" "${result#test result: }; $((SECONDS - start)) s"
    else
      grep -E "panicked|FAILED" <<<"$out" | head -20
      line FAIL "$name" "exit $status; ${result:-no result}; $((SECONDS - start)) s"
    fi
  done

  echo "== models, bf16 step, NCCL"
  checks=$(timeout 300 "$bin/gpu_check" models bf16 nccl 2>&1)
  status=$?
  # The runs' own logs, then the verdicts.
  grep -v -E "^(PASS|FAIL|SKIP) " <<<"$checks" | grep -E "^>|error|panicked" | head -40
  grep -E "^(PASS|FAIL|SKIP) " <<<"$checks"
  failed=$((failed + $(grep -c "^FAIL " <<<"$checks")))
  if [ $status -ne 0 ] && ! grep -q "^FAIL " <<<"$checks"; then
    line FAIL "gpu_check" "exit $status (124: over its time limit)"
  fi

  echo "== $failed failure(s)"
  [ $failed -eq 0 ]
}

case "${1:-}" in
  build) shift; build "$@" ;;
  "") run_checks ;;
  *) echo "usage: scripts/gpu_check.sh [build [--dev]]" >&2; exit 2 ;;
esac
