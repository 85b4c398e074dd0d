"""bench/lm_eval/compare.py: two lm-evaluation-harness runs compared sample by
sample, from the samples files lm_eval --log_samples writes."""
import json

from bench.lm_eval.compare import main


def _run(root, task: str, rows: list[list]) -> None:
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"samples_{task}_2026-11-30T11-00-00.jsonl", "w") as f:
        for doc_id, resps in enumerate(rows):
            f.write(json.dumps({"doc_id": doc_id, "filtered_resps": resps}) + "\n")


def test_loglikelihoods_and_generations_are_compared_sample_by_sample(tmp_path, capsys):
    _run(tmp_path / "a" / "m", "mc", [[["-1.5", "True"], ["-3.0", "False"]], [["-2.0", "False"]]])
    _run(tmp_path / "b" / "m", "mc", [[["-1.50002", "True"], ["-3.0", "True"]], [["-2.1", "False"]]])
    _run(tmp_path / "a" / "m", "gen", [["x = 1"], ["def f():"]])
    _run(tmp_path / "b" / "m", "gen", [["x = 1"], ["def g():"]])
    assert main([str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "out.json")]) == 0
    result = json.loads((tmp_path / "out.json").read_text())
    assert json.loads(capsys.readouterr().out) == result
    mc = result["mc"]
    assert (mc["kind"], mc["docs"], mc["requests"], mc["is_greedy_equal"]) == ("loglikelihood", 2, 3, 2)
    assert abs(mc["max_abs_diff"] - 0.1) < 1e-9 and abs(mc["median_abs_diff"] - 2e-5) < 1e-9
    assert result["gen"] == {"kind": "generation", "docs": 2, "requests": 2, "identical": 1}
