#!/usr/bin/env bash
# Every GPU path in one command, for a lent GPU machine (one H200, no network, no Rust
# registry): the binaries are built here, carried over with the working tree, and run there.
#
#   scripts/gpu_check.sh build          # here: release binaries, stripped, in the payload
#   scripts/gpu_check.sh build --dev    # the same in the dev profile (CI; quicker to build)
#   scripts/gpu_check.sh                # there (or here): run every check on the payload
#   GPU_CHECK_NCCL=1 scripts/gpu_check.sh build   # here: also comm_suite, bert_pretrain and
#                                                 # gpt_pretrain (for `nccl` below)
#   GPU_CHECK_AUTOTUNE=1 ... build      # here: also gpu_check with Burn's autotune (bf16 A/B)
#   scripts/gpu_check.sh nccl           # there: scripts/nccl_check.sh on the payload's binaries
#                                       # (ranks sharing one GPU: see nccl_check.sh), ≤ 420 s
#   scripts/gpu_check.sh bench          # there: our bf16 steps against PyTorch's, with a
#                                       # per-kernel profile and a table last, ≤ 540 s
#   scripts/gpu_check.sh bench-1b       # there: the same for a 1B Llama at seq 2048 (base
#                                       # payload only), ≤ 330 s
#
# The payload is target/gpu_check_payload/ (ignored by git, so carry it: the device tool's
# `run` with the carry `build` prints for each mode): xz tarballs of stripped binaries built
# with `--features cuda,wgpu` (about 70 MiB each stripped; packed, about a sixth):
# `base.tar.xz`, `gpu_check` (the libraries, BERT and GPT against the CPU, bf16 BERT-large and
# GPT steps' TFLOP/s, NCCL on one rank) with the shared libraries the binaries link beyond
# glibc (fontconfig, freetype and theirs: the lent H200 machine has none of them);
# `kernels.tar.xz` (every CubeCL kernel against its reference); `nccl.tar.xz` (comm_suite,
# gpt_pretrain, bert_pretrain) and `autotune.tar.xz` (gpu_check with Burn's autotune) when
# asked for. A mode carries base plus its own: the checks kernels, nccl nccl, bench autotune.
# CUDA, NVRTC, NCCL and Vulkan are loaded at run time, so the
# binaries start anywhere; what the machine lacks is reported and skipped, the rest runs.
# One line per check: PASS, FAIL or SKIP, with the numbers. The exit status is 1 if
# anything failed.
#
# The bindings (cudarc) dlopen `libnvrtc.so.13` or `libnvrtc.so`: a machine may hold NVRTC
# only in the CUDA toolkit's or a pip wheel's lib directory, and the run links what it finds
# there into target/gpu_check_libs, on LD_LIBRARY_PATH. NCCL is loaded by the library itself
# as `libnccl.so.2`; the run puts the directory holding it (PyTorch's wheel's, say) on
# LD_LIBRARY_PATH, with no link. For a machine with no NVRTC at all, build with
# GPU_CHECK_NVRTC=/path/to/libnvrtc.so.13 (e.g. torch's nvidia/cu13/lib): the payload then
# carries it and its builtins, used only when the machine has none.
set -uo pipefail
cd "$(dirname "$0")/.."
payload=${GPU_CHECK_PAYLOAD:-target/gpu_check_payload}
# The payload's features. CI builds it with the test step's features
# (GPU_CHECK_FEATURES=cuda,wgpu,mpi), so that cargo reuses that build instead of compiling Burn
# a second time; a payload for the GPU machine leaves out mpi, which it has no library for.
features=${GPU_CHECK_FEATURES:-cuda,wgpu}

build() {
  set -e
  local profile=release
  if [ "${1:-}" = "--dev" ]; then profile=dev; fi
  # One cargo invocation for both binaries, so that they share one feature resolution and
  # Burn is compiled once (two invocations compiled it twice: ~6 min in the dev profile).
  # The binaries' paths are in cargo's JSON messages.
  local messages
  # cubecl-llvm (our stand-in, a workspace member) is selected too: a workspace-wide build turns
  # on its default features, and without them here cargo would compile Burn's CUDA half again
  # instead of reusing CI's test build.
  # With GPU_CHECK_NCCL=1, NCCL's multi-rank check's binaries too (in the same invocation).
  local extra=()
  if [ -n "${GPU_CHECK_NCCL:-}" ]; then
    extra=(-p burn-megatron-tests --bin comm_suite --example bert_pretrain --example gpt_pretrain)
  fi
  messages=$(cargo build --profile "$profile" -p burn-megatron-examples -p burn-megatron-kernels \
    -p cubecl-llvm --features "$features" --example gpu_check --test kernels "${extra[@]}" \
    --message-format=json-render-diagnostics)
  local example kernels
  example=$(grep -o '"executable":"[^"]*/gpu_check[^"/]*"' <<<"$messages" | tail -1 | cut -d'"' -f4)
  kernels=$(grep -o '"executable":"[^"]*/kernels-[^"/]*"' <<<"$messages" | tail -1 | cut -d'"' -f4)
  [ -x "$example" ] || { echo "gpu_check: the gpu_check example was not built" >&2; exit 1; }
  [ -x "$kernels" ] || { echo "gpu_check: the kernel test binary was not built" >&2; exit 1; }
  local staging=target/gpu_check_staging
  rm -rf "$payload" "$staging" && mkdir -p "$payload" "$staging"
  cp "$example" "$staging/gpu_check"
  cp "$kernels" "$staging/kernels"
  local binaries=(gpu_check kernels) name path
  if [ -n "${GPU_CHECK_NCCL:-}" ]; then
    for name in comm_suite bert_pretrain gpt_pretrain; do
      path=$(grep -o "\"executable\":\"[^\"]*/$name\"" <<<"$messages" | tail -1 | cut -d'"' -f4)
      [ -x "$path" ] || { echo "gpu_check: $name was not built" >&2; exit 1; }
      cp "$path" "$staging/$name"
      binaries+=("$name")
    done
  fi
  # With GPU_CHECK_AUTOTUNE=1, gpu_check once more with Burn's autotune (a second feature set:
  # cargo keeps both builds), so that one run times the bf16 steps with and without it.
  if [ -n "${GPU_CHECK_AUTOTUNE:-}" ]; then
    messages=$(cargo build --profile "$profile" -p burn-megatron-examples \
      --features "$features,autotune" --example gpu_check --message-format=json-render-diagnostics)
    path=$(grep -o '"executable":"[^"]*/gpu_check[^"/]*"' <<<"$messages" | tail -1 | cut -d'"' -f4)
    [ -x "$path" ] || { echo "gpu_check: the autotune gpu_check was not built" >&2; exit 1; }
    cp "$path" "$staging/gpu_check_autotune"
    binaries+=(gpu_check_autotune)
  fi
  (cd "$staging" && strip "${binaries[@]}")
  # The shared libraries the binaries need beyond glibc (fontconfig and freetype, for the
  # loss plots), which a bare GPU machine lacks: carried, used when the machine has none.
  mkdir -p "$staging/lib"
  (cd "$staging" && ldd "${binaries[@]}") | awk '/=> \// {print $3}' | sort -u |
    grep -v -E '/(libc|libm|libgcc_s|libdl|libpthread|librt|ld-linux[^/]*)\.so' |
    xargs -r cp -L -t "$staging/lib"
  echo "stripped: $(du -cb "$staging"/* | tail -1 | cut -f1) bytes"
  # One tarball per use, so that a device run carries only what its mode needs (all six
  # binaries packed are over the 64 MiB a run carries).
  pack() { # NAME FILES...
    local name=$1
    shift
    tar -C "$staging" -cf - "$@" | xz -T0 -6 >"$payload/$name.tar.xz"
  }
  pack base gpu_check lib
  pack kernels kernels
  [ -n "${GPU_CHECK_NCCL:-}" ] && pack nccl comm_suite gpt_pretrain bert_pretrain
  [ -n "${GPU_CHECK_AUTOTUNE:-}" ] && pack autotune gpu_check_autotune
  rm -rf "$staging"
  if [ -n "${GPU_CHECK_NVRTC:-}" ]; then
    (cd "$(dirname "$GPU_CHECK_NVRTC")" &&
      tar -cf - "$(basename "$GPU_CHECK_NVRTC")" libnvrtc-builtins.so.*) |
      xz -T0 -9 >"$payload/nvrtc.tar.xz"
  fi
  echo "payload: $payload ($profile profile):"
  ls -la "$payload"
  # What each mode carries (the NVRTC tarball goes with every one when it was made).
  local mode files bytes over=0
  for mode in "checks:base kernels" "nccl:base nccl" "bench:base autotune" "bench-1b:base"; do
    files=()
    for f in ${mode#*:} nvrtc; do
      [ -f "$payload/$f.tar.xz" ] && files+=("$payload/$f.tar.xz")
    done
    bytes=$(du -cb "${files[@]}" | tail -1 | cut -f1)
    echo "${mode%%:*}: $((bytes / 1048576)) MiB; carry=[$(printf '"%s",' "${files[@]}" | sed 's/,$//')]"
    ((bytes > 64 * 1048576)) && over=1
  done
  if ((over)); then
    echo "gpu_check: a mode's payload is over the 64 MiB a device run carries" >&2
    exit 1
  fi
  echo "run: scripts/gpu_check.sh [nccl | bench | bench-1b] with that mode's carry, timeout_s=600"
}

# check NAME STATUS DETAIL: one report line (and the failure count).
failed=0
line() {
  echo "$1 $2: $3"
  if [ "$1" = FAIL ]; then failed=$((failed + 1)); fi
}

# NVRTC and NCCL under the names the bindings load, linked into $libs (on LD_LIBRARY_PATH)
# from wherever this machine keeps them, or NVRTC from the payload as a last resort.
libs=target/gpu_check_libs
find_libraries() {
  rm -rf "$libs" && mkdir -p "$libs"
  export LD_LIBRARY_PATH="$PWD/$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  local roots=(/usr/local/cuda*/lib64 /usr/local/cuda*/targets/*/lib /usr/lib/x86_64-linux-gnu
    /usr/lib64 /opt)
  # Python's site directories (the user's too) and the one torch is in, without importing it.
  local site
  for site in $(env LD_LIBRARY_PATH="$(py_ld)" python3 -c 'import importlib.util as u, os, site
dirs = site.getsitepackages() + [site.getusersitepackages()]
spec = u.find_spec("torch")
if spec and spec.origin: dirs.append(os.path.dirname(os.path.dirname(spec.origin)))
print(" ".join(dict.fromkeys(dirs)))' 2>/dev/null); do
    roots+=("$site/nvidia")
  done
  local existing=() r found b
  for r in "${roots[@]}"; do [ -d "$r" ] && existing+=("$r"); done
  if ! ldconfig -p 2>/dev/null | grep -q 'libnvrtc\.so'; then
    found=$(find "${existing[@]}" -maxdepth 4 -name 'libnvrtc.so.1[2-9]*' 2>/dev/null | sort | tail -1)
    if [ -z "$found" ] && [ -f "$payload/nvrtc.tar.xz" ]; then
      mkdir -p "$libs/carried" && xz -dc "$payload/nvrtc.tar.xz" | tar -C "$libs/carried" -xf -
      found=$(ls "$libs"/carried/libnvrtc.so.* 2>/dev/null | head -1)
      [ -n "$found" ] && echo "libnvrtc: none on this machine; the payload's is used"
    fi
    if [ -n "$found" ]; then
      ln -sf "$(readlink -f "$found")" "$libs/libnvrtc.so"
      for b in "$(dirname "$found")"/libnvrtc-builtins.so*; do
        [ -e "$b" ] && ln -sf "$(readlink -f "$b")" "$libs/$(basename "$b")"
      done
    fi
  fi
  if ! ldconfig -p 2>/dev/null | grep -q 'libnccl\.so\.2 '; then
    found=$(find "${existing[@]}" -maxdepth 4 -name 'libnccl.so.2' 2>/dev/null | sort | tail -1)
    [ -n "$found" ] && export LD_LIBRARY_PATH="$(dirname "$found"):$LD_LIBRARY_PATH"
  fi
  # cuBLASLt (the linear layers' GEMMs) under the name cudarc tries, libcublasLt.so.13 or .12
  # (PyTorch's wheel's nvidia/cu13/lib, say); without it the GEMMs stay cubek's.
  if ! ldconfig -p 2>/dev/null | grep -q 'libcublasLt\.so\.1[2-9] '; then
    found=$(find "${existing[@]}" -maxdepth 4 -name 'libcublasLt.so.1[2-9]' 2>/dev/null | sort | tail -1)
    [ -n "$found" ] && export LD_LIBRARY_PATH="$(dirname "$found"):$LD_LIBRARY_PATH"
  fi
}

# Every step is bounded by its own limit and by what is left of GPU_CHECK_BUDGET_S (default
# 560 s), so the whole run fits the device tool's 600 s. Each step's whole output is kept in
# $logs (GPU_CHECK_LOGS; by default under $OUT on the device machine, so that it comes back).
bin=target/gpu_check_bin
budget=${GPU_CHECK_BUDGET_S:-560}
# bounded LIMIT: LIMIT, or what is left of the budget if less (0 when under 10 s are left).
bounded() {
  local left=$((budget - SECONDS))
  ((left < 10)) && left=0
  echo $(($1 < left ? $1 : left))
}
# Python without the carried libraries (Debian's zlib or expat beside torch's would be a risk).
carried=
py_ld() { tr ':' '\n' <<<"${LD_LIBRARY_PATH:-}" | grep -v -x -F "${carried:-/nonexistent}" | paste -sd:; }
# Unpacks the payload into $bin and puts the libraries the binaries need on the loader path.
unpack() {
  # The Vulkan loader complains on every probe without one.
  if [ -z "${XDG_RUNTIME_DIR:-}" ]; then
    export XDG_RUNTIME_DIR=$(mktemp -d)
  fi
  [ -f "$payload/base.tar.xz" ] ||
    { echo "gpu_check: no $payload/base.tar.xz: run 'scripts/gpu_check.sh build' first" >&2; exit 2; }
  rm -rf "$bin" && mkdir -p "$bin"
  local part
  xz -dc "$payload/base.tar.xz" | tar -C "$bin" -xf - ||
    { echo "gpu_check: $payload/base.tar.xz does not unpack" >&2; exit 2; }
  # The other parts are each a mode's own: one that does not unpack only loses its checks.
  for part in kernels nccl autotune; do
    [ -f "$payload/$part.tar.xz" ] || continue
    xz -dc "$payload/$part.tar.xz" | tar -C "$bin" -xf - ||
      echo "gpu_check: $payload/$part.tar.xz does not unpack; its checks are skipped" >&2
  done
  # The carried libraries only where the machine lacks one of them (the loader then fails
  # before main: exit 127).
  if ! timeout 20 "$bin/gpu_check" --help >/dev/null 2>&1; then
    echo "the binaries do not start with this machine's libraries; adding the carried ones"
    carried=$PWD/$bin/lib
    export LD_LIBRARY_PATH="$carried${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  fi
}

# NCCL at 2 and 4 ranks (on one GPU, ranks share it; see scripts/nccl_check.sh), bounded to
# 420 s: no check starts after 400 s, and a terminated nccl_check stops its checks and
# prints what finished. With a machine's start-up, that is one mode per 15-minute loan.
run_nccl() {
  unpack
  [ -x "$bin/comm_suite" ] && [ -x "$bin/bert_pretrain" ] && [ -x "$bin/gpt_pretrain" ] ||
    { echo "gpu_check: the payload has no NCCL binaries: build it with GPU_CHECK_NCCL=1" >&2; exit 2; }
  find_libraries
  local out=${NCCL_CHECK_OUT:-${OUT:-target}/nccl_check} status
  NCCL_CHECK_OUT=$out NCCL_CHECK_BIN=$bin timeout -k 15 420 scripts/nccl_check.sh
  status=$?
  # Killed before it could report: the checks that finished.
  if ((status == 124 || status == 137)) && [ ! -f "$out/summary.txt" ]; then
    echo "== nccl_check was killed; the checks that finished ($(ls "$out/results" | wc -l)):"
    sort -k2 "$out"/results/* 2>/dev/null
  fi
  return $status
}

# The speed benchmark: PyTorch's bf16 steps of the same models and cuBLAS's GEMM rate
# (scripts/torch_ref/torch_gpu_ref.py), our steps with each gpu_check in the payload (plain,
# and with Burn's autotune when built with GPU_CHECK_AUTOTUNE=1), each with its GEMM engines,
# attention backends and stream orders in turn (gpu_check's --bf16-variants: cuBLASLt ordered
# on the device, the same with the chunked and with the flash attention, cuBLASLt ordered by
# host syncs, cubek;
# the autotuned build only the first, autotune being cubek's), one CubeCL-profiled run of the plain build's GPT
# (GPU_BENCH_PROFILE=0 skips it), and the table (scripts/gpu_bench.py) last. Bounded to 540 s
# in all (150 + 250 + 70 + 60 + 10 at most).
run_bench() {
  unpack
  find_libraries
  logs=${GPU_CHECK_LOGS:-${OUT:-target}/gpu_bench}
  rm -rf "$logs" && mkdir -p "$logs"
  timeout 20 nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total \
    --format=csv,noheader 2>/dev/null
  echo "== PyTorch (eager) and cuBLAS"
  timeout 150 env LD_LIBRARY_PATH="$(py_ld)" python3 scripts/torch_ref/torch_gpu_ref.py >"$logs/torch.log" 2>&1
  grep -E "^(torch|TORCH)" "$logs/torch.log" ||
    { echo "PyTorch's run printed no timings:"; tail -3 "$logs/torch.log"; }
  local variant binary variants limit
  for variant in plain autotune; do
    binary=$bin/gpu_check variants=cublaslt,chunked,flash,host-order,cubecl limit=250
    [ "$variant" = autotune ] && binary=$bin/gpu_check_autotune variants=cublaslt limit=70
    [ -x "$binary" ] || continue
    echo "== ours ($variant: $variants)"
    timeout $limit "$binary" bf16 --bf16-variants $variants --out "$logs" \
      >"$logs/ours-$variant.log" 2>&1
    grep -E "^(PASS|FAIL|SKIP) |panicked" "$logs/ours-$variant.log"
    if [ "$variant" = plain ] && [ "${GPU_BENCH_PROFILE:-1}" = 1 ]; then
      CUBECL_DEBUG_OPTION=profile CUBECL_DEBUG_LOG="$logs/ours-$variant-gpt.prof" \
        timeout 60 "$binary" bf16 --bf16-models gpt --out "$logs" \
        >"$logs/profiled-$variant-gpt.txt" 2>&1
    fi
  done
  echo "== the table"
  timeout 10 env LD_LIBRARY_PATH="$(py_ld)" python3 scripts/gpu_bench.py "$logs" | tee "$logs/table.txt"
  # The profile also logs every kernel's source (CUBECL_DEBUG_LOG turns that on): packed.
  xz -T0 -3 "$logs"/*.prof 2>/dev/null
  return 0
}

# Issue 43's 1B-class target: PyTorch's step of the 1B Llama (gpu_check's `llama1b`,
# TinyLlama-1.1B's shape at seq 2048, micro-batch 8, vocab 32000) with cuBLAS's rate at its
# GEMMs, ours with the flash and the chunked attention (cuBLASLt GEMMs), and the table.
# Carries `base` alone. Bounded to 330 s (90 + 230 + 10 at most).
run_bench_1b() {
  unpack
  find_libraries
  logs=${GPU_CHECK_LOGS:-${OUT:-target}/gpu_bench_1b}
  rm -rf "$logs" && mkdir -p "$logs"
  echo "== PyTorch (eager) and cuBLAS, the 1B Llama"
  timeout 90 env LD_LIBRARY_PATH="$(py_ld)" python3 scripts/torch_ref/torch_gpu_ref.py --config=22,2048,32,4,5632,2048,8,32000 \
    >"$logs/torch.log" 2>&1
  grep -E "^(torch|TORCH)" "$logs/torch.log" ||
    { echo "PyTorch's run printed no timings:"; tail -3 "$logs/torch.log"; }
  echo "== ours (flash, chunked)"
  timeout 230 "$bin/gpu_check" bf16 --bf16-models llama1b --bf16-variants flash,chunked \
    --out "$logs" >"$logs/ours-plain.log" 2>&1
  grep -E "^(PASS|FAIL|SKIP) |panicked" "$logs/ours-plain.log"
  echo "== the table"
  timeout 10 env LD_LIBRARY_PATH="$(py_ld)" python3 scripts/gpu_bench.py "$logs" | tee "$logs/table.txt"
  # The profile also logs every kernel's source (CUBECL_DEBUG_LOG turns that on): packed.
  xz -T0 -3 "$logs"/*.prof 2>/dev/null
  return 0
}

run_checks() {
  unpack
  logs=${GPU_CHECK_LOGS:-${OUT:-target}/gpu_check}
  mkdir -p "$logs"
  echo "== machine"
  timeout 20 nvidia-smi -L 2>/dev/null || echo "nvidia-smi: none"
  timeout 20 nvidia-smi --query-gpu=driver_version,memory.total --format=csv,noheader 2>/dev/null
  find_libraries
  for lib in libcuda.so libnvrtc.so; do
    found=$(ldconfig -p 2>/dev/null | grep -m1 "$lib" | awk '{print $NF}')
    linked=$(ls "$libs/$lib" 2>/dev/null)
    [ -n "$linked" ] && found="$(readlink -f "$linked") (linked into $libs)"
    echo "$lib: ${found:-not on the loader path (LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-})}"
  done
  echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-} (NCCL: see the libraries check)"
  icds=$(ls /usr/share/vulkan/icd.d/*.json /etc/vulkan/icd.d/*.json 2>/dev/null | tr '\n' ' ')
  echo "Vulkan ICDs: ${icds:-none}"
  echo "payload: $(du -sh "$payload" | cut -f1) packed, $(du -sh "$bin" | cut -f1) unpacked"

  echo "== libraries and devices"
  devices=$(timeout "$(bounded 30)" "$bin/gpu_check" libraries)
  echo "$devices"

  echo "== kernels"
  local dev limit
  for dev in cuda:180 wgpu:90; do
    limit=$(bounded "${dev#*:}")
    dev=${dev%:*}
    name="kernels on $dev"
    if ! grep -q "^PASS device $dev:" <<<"$devices"; then
      why=$(grep "device $dev:" <<<"$devices" | cut -d: -f2- | sed 's/^ //')
      line SKIP "$name" "${why:-the libraries check printed nothing for $dev}"
      continue
    fi
    if [ ! -x "$bin/kernels" ]; then
      line SKIP "$name" "the payload has no kernels.tar.xz (carried without it)"
      continue
    fi
    if ((limit == 0)); then
      line SKIP "$name" "no time left of the ${budget} s budget"
      continue
    fi
    kind=$dev
    [ "$dev" = wgpu ] && kind=wgpu-gpu
    start=$SECONDS
    # CUDA compiles every kernel variant through NVRTC on first use: 90 s on an H200.
    KERNEL_TEST_DEVICE=$kind timeout -k 10 "$limit" "$bin/kernels" on_cube >"$logs/kernels-$dev.log" 2>&1
    status=$?
    out=$(cat "$logs/kernels-$dev.log")
    result=$(grep -m1 "^test result" <<<"$out")
    if [ $status -eq 0 ]; then
      line PASS "$name" "${result#test result: }; $((SECONDS - start)) s"
    else
      grep -E "panicked|FAILED" <<<"$out" | head -20
      line FAIL "$name" "exit $status; ${result:-no result}; $((SECONDS - start)) s"
    fi
  done

  # One process per check, so that a crash in one (a kernel the driver refuses, say) still
  # leaves the others' lines.
  local check
  for check in models:150 bf16:120 nccl:30 nvrtc:60; do
    limit=$(bounded "${check#*:}")
    check=${check%:*}
    echo "== $check"
    if ((limit == 0)); then
      line SKIP "gpu_check $check" "no time left of the ${budget} s budget"
      continue
    fi
    timeout -k 10 "$limit" "$bin/gpu_check" "$check" --out "$logs" >"$logs/$check.log" 2>&1
    status=$?
    checks=$(cat "$logs/$check.log")
    # The run's own logs, then the verdicts.
    grep -v -E "^(PASS|FAIL|SKIP) " <<<"$checks" | grep -E "^>|error|panicked" | head -40
    grep -E "^(PASS|FAIL|SKIP) " <<<"$checks"
    failed=$((failed + $(grep -c "^FAIL " <<<"$checks")))
    if [ $status -ne 0 ] && ! grep -q "^FAIL " <<<"$checks"; then
      line FAIL "gpu_check $check" "exit $status (124: over its $limit s)"
    fi
  done

  echo "== $failed failure(s)"
  [ $failed -eq 0 ]
}

# A run mode's whole output also goes to a file (under $OUT on the device machine, whose
# reply holds only the output's tail).
logged() { # NAME FUNCTION
  local dir=${OUT:-target}
  mkdir -p "$dir"
  "$2" 2>&1 | tee "$dir/gpu_check-$1.txt"
  return "${PIPESTATUS[0]}"
}

case "${1:-}" in
  build) shift; build "$@" ;;
  nccl) logged nccl run_nccl ;;
  bench) logged bench run_bench ;;
  bench-1b) logged bench-1b run_bench_1b ;;
  "") logged checks run_checks ;;
  *) echo "usage: scripts/gpu_check.sh [build [--dev] | nccl | bench | bench-1b]" >&2; exit 2 ;;
esac
