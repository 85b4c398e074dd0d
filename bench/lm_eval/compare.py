"""Compares two lm-evaluation-harness runs of the same tasks sample by sample:
for example Tandem's HTTP API (`--model local-completions`) against the target
alone (`--model hf`). lm-evaluation-harness is not one of Tandem's
dependencies; install it where you run it (`pip install "lm-eval[api]"`, and
torch and transformers for its hf model).

Loglikelihood requests (multiple choice): the largest and the median
difference of the log likelihoods, and how many "is greedy" flags agree.
Generation requests: how many outputs are identical.

    python -m bench.lm_eval.compare RUN_DIR_A RUN_DIR_B [--out FILE]

Each RUN_DIR is an `lm_eval --output_path` of a run with `--log_samples`; the
newest samples file of each task is read. Prints the comparison as JSON."""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def samples(run_dir: Path) -> dict[str, dict[int, list]]:
    """task -> doc_id -> the responses of the newest samples file of the task."""
    newest: dict[str, Path] = {}
    for path in sorted(run_dir.rglob("samples_*.jsonl"), key=lambda p: p.stat().st_mtime):
        newest[path.name.removeprefix("samples_").rsplit("_", 1)[0]] = path
    return {task: {(s := json.loads(line))["doc_id"]: s["filtered_resps"] for line in path.read_text().splitlines()}
            for task, path in newest.items()}


def compare(a: dict[int, list], b: dict[int, list]) -> dict:
    docs = sorted(set(a) & set(b))
    pairs = [(x, y) for doc in docs for x, y in zip(a[doc], b[doc])]
    if pairs and isinstance(pairs[0][0], list):  # [log likelihood, is greedy]
        diffs = [abs(float(x[0]) - float(y[0])) for x, y in pairs]
        return {"kind": "loglikelihood", "docs": len(docs), "requests": len(pairs),
                "max_abs_diff": max(diffs), "median_abs_diff": statistics.median(diffs),
                "is_greedy_equal": sum(str(x[1]) == str(y[1]) for x, y in pairs)}
    return {"kind": "generation", "docs": len(docs), "requests": len(pairs),
            "identical": sum(x == y for x, y in pairs)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("a", type=Path, help="an lm_eval --output_path (with --log_samples)")
    parser.add_argument("b", type=Path, help="another, of the same tasks")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here (default: stdout only)")
    args = parser.parse_args(argv)
    runs = samples(args.a), samples(args.b)
    result = {task: compare(runs[0][task], runs[1][task]) for task in sorted(set(runs[0]) & set(runs[1]))}
    if not result:
        parser.error("the two runs share no task with logged samples")
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
