"""Two `--log-json` runs of gpt_pretrain or bert_pretrain, compared iteration by iteration.

  python3 scripts/compare_runs.py NAME REFERENCE.json RUN.json LIMIT [--from N]

Compares lm_loss, sop_loss (BERT) and grad_norm at every iteration both logs hold (from
iteration N on with --from: a run resumed from a checkpoint against the run that saved it),
prints one line with the largest relative difference, and exits 1 when it is over LIMIT or
the logs share no iteration.
"""
import json
import sys


def read(path):
    with open(path) as f:
        return {e["iteration"]: e for e in map(json.loads, filter(str.strip, f))}


def main():
    args = sys.argv[1:]
    first = 0
    if "--from" in args:
        i = args.index("--from")
        first = int(args[i + 1])
        del args[i:i + 2]
    name, ref_path, run_path, limit = args[0], args[1], args[2], float(args[3])
    ref, run = read(ref_path), read(run_path)
    common = sorted(i for i in ref.keys() & run.keys() if i >= first)
    if not common:
        print(f"FAIL {name}: no common iterations ({len(ref)} and {len(run)} logged)")
        sys.exit(1)
    worst, where = 0.0, None
    for i in common:
        for key in ("lm_loss", "sop_loss", "grad_norm"):
            a, b = ref[i].get(key), run[i].get(key)
            if a is None and b is None:
                continue
            if a is None or b is None:
                print(f"FAIL {name}: iteration {i} {key}: {a} against {b}")
                sys.exit(1)
            rel = abs(a - b) / max(abs(a), 1e-12)
            if rel > worst:
                worst, where = rel, (i, key, a, b)
    verdict = "PASS" if worst <= limit else "FAIL"
    detail = f"iteration {where[0]} {where[1]} {where[2]:.7g} vs {where[3]:.7g}" if where else "identical"
    print(f"{verdict} {name}: iterations {common[0]}-{common[-1]}, largest relative difference "
          f"{worst:.2e} (limit {limit:g}; {detail})")
    sys.exit(0 if verdict == "PASS" else 1)


if __name__ == "__main__":
    main()
