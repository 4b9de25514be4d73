"""The GPU benchmark's table: our bf16 steps against PyTorch's, from one run's logs.

  python3 scripts/gpu_bench.py LOGS

LOGS holds what `scripts/gpu_check.sh bench` (or `bench-1b`) wrote there:
  torch.log                  scripts/torch_ref/torch_gpu_ref.py (PyTorch eager, cuBLAS GEMMs;
                             bench-1b: its --config run of the 1B Llama)
  ours-VARIANT.log           `gpu_check bf16` of one build (VARIANT: plain, autotune)
  ours-VARIANT-FAMILY.prof   CubeCL's per-kernel table (CUBECL_DEBUG_OPTION=profile) of a
                             separate run of one model (FAMILY: gpt, bert)

Prints, per model: milliseconds per step, TFLOP/s, MFU against the H200's dense bf16 peak
(989) and against the cuBLAS GEMM rate measured in the same run, device memory, and the
ratio to PyTorch eager; then each profile's kernel groups. Exits 1 when a log is missing.
"""
import glob
import os
import re
import statistics
import sys

PEAK = 989.0
# A kernel's group: the first pattern its name matches (case-insensitive).
GROUPS = [
    # The kernel on CubeCL's stream that waits for cuBLASLt's GEMM on ours: the GEMM's time as
    # CubeCL's stream sees it (src/cuda/order.rs).
    ("GEMM (cuBLASLt, waited for)", r"wait_kernel"),
    ("collectives", r"nccl|all_?reduce|all_?gather|reduce_?scatter"),
    ("GEMM", r"matmul|gemm|cmma|mma\b"),
    ("attention", r"attention|flash|softmax"),
    ("norms", r"norm|dgamma|rms"),
    ("optimizer", r"adam|optim"),
    ("loss", r"cross_?entropy"),
    ("copies/casts", r"copy|cast|contiguous|layout|slice|concat|\bcat\b|gather|scatter|"
                     r"reshape|permute|transpose|index|select"),
    ("elementwise", r"."),
]
UNITS = {"ns": 1e-6, "µs": 1e-3, "us": 1e-3, "ms": 1.0, "s": 1e3}


def read(path):
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return None


def torch_runs(text):
    """{model: (ms, tflops, peak GiB)} of PyTorch eager, and the cuBLAS rates."""
    runs, gemms = {}, {}
    for m in re.finditer(r"^TORCH (.+?) eager: median ([\d.]+) ms.*?, ([\d.]+) TFLOP/s, "
                         r"peak ([\d.]+) GiB", text, re.M):
        runs[m.group(1)] = (float(m.group(2)), float(m.group(3)), float(m.group(4)))
    for m in re.finditer(r"^TORCH matmul bf16 (\S+): ([\d.]+) TFLOP/s", text, re.M):
        gemms[m.group(1)] = float(m.group(2))
    return runs, gemms


def our_runs(text):
    """{(family, variant): (ms, tflops, memory text, per-step counts)} from gpu_check bf16's
    PASS lines (the variant in parentheses after the device; `default` without one)."""
    runs = {}
    for line in text.splitlines():
        m = re.match(r"^PASS bf16 (GPT|BERT|LLAMA1B) .*? step on \S+(?: \(([\w-]+)\))?: ([\d.]+) ms.*?, "
                     r"([\d.]+) TFLOP/s", line)
        if not m:
            continue
        mem = re.search(r"device memory ([^;]*)", line)
        per = re.search(r"per step: ([^;(]*)", line)
        runs[(m.group(1).lower(), m.group(2) or "default")] = (
            float(m.group(3)), float(m.group(4)), mem.group(1).strip() if mem else "",
            per.group(1).strip() if per else "")
    return runs


def duration_ms(text):
    m = re.match(r"([\d.]+)(ns|µs|us|ms|s)$", text.strip())
    return float(m.group(1)) * UNITS[m.group(2)] if m else None


def profile_groups(text):
    """[(group, ms, share, top kernel)] from CubeCL's table, largest first."""
    totals, top = {}, {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4 or cells[0] in ("Name", "Total"):
            continue
        ms = duration_ms(cells[1])
        if ms is None:
            continue
        group = next(g for g, p in GROUPS if re.search(p, cells[0], re.I))
        totals[group] = totals.get(group, 0.0) + ms
        if ms > top.get(group, ("", 0.0))[1]:
            top[group] = (cells[0], ms)
    whole = sum(totals.values()) or 1.0
    return sorted(((g, ms, ms / whole, top[g][0]) for g, ms in totals.items()),
                  key=lambda r: -r[1])


def main():
    logs = sys.argv[1]
    torch_text = read(os.path.join(logs, "torch.log"))
    if torch_text is None:
        print(f"gpu_bench: no {logs}/torch.log")
        sys.exit(1)
    torch, gemms = torch_runs(torch_text)
    # The cuBLAS rate at the step's own GEMM shapes (not 8192^3).
    step_gemms = [r for shape, r in gemms.items() if shape != "8192x8192x8192"]
    cublas = statistics.median(step_gemms) if step_gemms else None
    names = {"gpt": next((k for k in torch if k.startswith("GPT") and k.endswith("vocab 512")), None),
             "bert": next((k for k in torch if k.startswith("BERT")), None),
             "llama1b": next((k for k in torch if k.startswith("GPT 22x2048")), None)}
    variants = sorted(os.path.basename(p)[5:-4] for p in glob.glob(os.path.join(logs, "ours-*.log")))
    ours = {v: our_runs(read(os.path.join(logs, f"ours-{v}.log")) or "") for v in variants}
    if not variants:
        print(f"gpu_bench: no {logs}/ours-*.log")
        sys.exit(1)
    rate = f"{cublas:.0f}" if cublas else "?"
    print(f"cuBLAS bf16 GEMM: {rate} TFLOP/s at the step's shapes (median of "
          f"{', '.join(f'{s} {r:.0f}' for s, r in gemms.items() if s != '8192x8192x8192')})"
          + (f"; {gemms['8192x8192x8192']:.0f} at 8192^3" if "8192x8192x8192" in gemms else ""))
    print()
    print(f"| model | run | ms/step | TFLOP/s | MFU of 989 | of cuBLAS {rate} | memory | vs eager "
          f"| per step |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for family in ("gpt", "bert", "llama1b"):
        name = names[family]
        if not name and not any(f == family for runs in ours.values() for f, _ in runs):
            continue
        eager = torch.get(name) if name else None
        label = name or family.upper()
        of_cublas = (lambda tf: f"{100 * tf / cublas:.1f} %") if cublas else (lambda tf: "?")
        if eager:
            ms, tf, mem = eager
            print(f"| {label} | PyTorch eager | {ms:.1f} | {tf:.0f} | {100 * tf / PEAK:.1f} % "
                  f"| {of_cublas(tf)} | {mem:.1f} GiB peak allocated | 1.00 | |")
        for v in variants:
            runs = sorted((inner, r) for (f, inner), r in ours[v].items() if f == family)
            if not runs:
                print(f"| {label} | ours ({v}) | no result | | | | | | |")
            for inner, (ms, tf, mem, per) in runs:
                ratio = f"{ms / eager[0]:.2f}x the time" if eager else "?"
                print(f"| {label} | ours ({v}, {inner}) | {ms:.1f} | {tf:.1f} | "
                      f"{100 * tf / PEAK:.1f} % | {of_cublas(tf)} | {mem} | {ratio} | {per} |")
    for path in sorted(glob.glob(os.path.join(logs, "ours-*.prof"))):
        groups = profile_groups(read(path) or "")
        print()
        print(f"kernel groups, {os.path.basename(path)[5:-5]} (all profiled steps):")
        if not groups:
            print("  (no CubeCL profile table in the log)")
        for g, ms, share, top in groups:
            print(f"  {g:<13} {ms:9.1f} ms {100 * share:5.1f} %   largest: {top[:70]}")


if __name__ == "__main__":
    main()
