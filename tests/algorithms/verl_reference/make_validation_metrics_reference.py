"""Writes validation_metrics_verl091.json: verl 0.9.1's own `bootstrap_metric`, `calc_maj_val` and
`process_validation_metrics` run on the inputs below, inputs and outputs both recorded (CI has no verl;
tests/algorithms/test_validation_metrics.py compares posttrain's functions with these outputs).

    python tests/algorithms/verl_reference/make_validation_metrics_reference.py /path/to/verl091

The argument is an unpacked verl 0.9.1 wheel (the folder holding ``verl/``). Importing
``verl.trainer.ppo.metric_utils`` needs torch, transformers and verl's other modules; the three
functions need only numpy, so their source is taken from that file as it is (its sha256 is recorded)
and run here. Not collected by pytest (no ``test_`` prefix); rerun it only to re-record.
"""

from __future__ import annotations

import ast
import hashlib
import json
import sys
from collections import defaultdict
from functools import partial
from pathlib import Path
from typing import Any, Callable

import numpy as np

NAMES = ("bootstrap_metric", "calc_maj_val", "process_validation_metrics")
OUT = Path(__file__).with_name("validation_metrics_verl091.json")


def load_verl(root: Path) -> tuple[dict[str, Callable], str]:
    path = root / "verl" / "trainer" / "ppo" / "metric_utils.py"
    source = path.read_text(encoding="utf-8")
    tree = ast.parse(source)
    chunks = [ast.get_source_segment(source, node) for node in tree.body
              if isinstance(node, ast.FunctionDef) and node.name in NAMES]
    assert len(chunks) == len(NAMES), "verl's metric_utils.py no longer defines all three functions"
    namespace = {"np": np, "defaultdict": defaultdict, "partial": partial, "Any": Any, "Callable": Callable}
    exec(compile("\n\n".join(chunks), str(path), "exec"), namespace)
    return {name: namespace[name] for name in NAMES}, hashlib.sha256(source.encode()).hexdigest()


def mixed_inputs(seed: int) -> dict:
    """Three sources, prompts with 1-13 responses, numbers (some None), bools, ints and text answers."""
    rng = np.random.default_rng(seed)
    sources, uids, infos = [], [], {"reward": [], "acc": [], "score": [], "turns": [], "pred": []}
    for s in range(3):
        for p in range(6):
            n = int(rng.choice([1, 2, 3, 5, 8, 13]))
            for _ in range(n):
                sources.append(f"source{s}")
                uids.append(f"s{s}-p{p}")
                infos["reward"].append(float(rng.choice([0.0, 0.1, 1.0])))
                infos["acc"].append(bool(rng.random() < 0.4))
                infos["score"].append(None if rng.random() < 0.1 else float(rng.normal()))
                infos["turns"].append(int(rng.integers(1, 4)))
                infos["pred"].append(str(rng.choice(["12", "13", "7", "[INVALID]"])))
    order = rng.permutation(len(sources))  # responses of one prompt are not next to each other
    return {"data_sources": [sources[i] for i in order], "sample_uids": [uids[i] for i in order],
            "infos_dict": {k: [v[i] for i in order] for k, v in infos.items()}}


def many_responses_inputs(seed: int) -> dict:
    """One source, 20 prompts x 16 responses, 0/1 accuracy and three answers (ties are common)."""
    rng = np.random.default_rng(seed)
    sources, uids, acc, pred = [], [], [], []
    for p in range(20):
        for _ in range(16):
            answer = str(rng.choice(["a", "b", "c"], p=[0.4, 0.35, 0.25]))
            sources.append("src")
            uids.append(f"p{p}")
            pred.append(answer)
            acc.append(float(answer == "a"))
    return {"data_sources": sources, "sample_uids": uids, "infos_dict": {"acc": acc, "reward": acc[:], "pred": pred}}


def main(root: Path) -> None:
    verl, digest = load_verl(root)
    rng = np.random.default_rng(0)
    cases: dict[str, list] = {"bootstrap_metric": [], "calc_maj_val": [], "process_validation_metrics": []}
    fns = {"mean": np.mean, "max": np.max, "min": np.min, "median": np.median}
    for data_seed, (size, subset, seed, n_boot) in enumerate([(5, 3, 42, 100), (9, 1, 42, 1000), (12, 7, 7, 1000),
                                                               (30, 16, 123, 500)]):
        data = [float(x) for x in np.random.default_rng(data_seed).normal(size=size).round(3)]
        out = verl["bootstrap_metric"](data, subset, [fns[f] for f in fns], n_bootstrap=n_boot, seed=seed)
        cases["bootstrap_metric"].append({"data": data, "subset_size": subset, "reduce_fns": list(fns),
                                          "n_bootstrap": n_boot, "seed": seed, "result": out})
    for _ in range(6):
        k = int(rng.integers(1, 9))
        data = [{"pred": str(rng.choice(["A", "B", "C"])), "val": round(float(rng.random()), 3)} for _ in range(k)]
        cases["calc_maj_val"].append({"data": data, "result": verl["calc_maj_val"](data, "pred", "val")})
    runs = [("mixed, seed 42", mixed_inputs(1), 42, None), ("mixed, seed 5", mixed_inputs(2), 5, None),
            ("16 responses", many_responses_inputs(3), 42, None)]
    acc_case = {"data_sources": ["a", "a", "a", "r"], "sample_uids": ["p1", "p1", "p2", "q"],
                "infos_dict": {"reward": [0.4, 0.6, 1.0, 0.5], "acc": [1.0, 0.0, 1.0, None]}}
    runs.append(("expected_acc_counts", acc_case, 42, [[["a", "p1"], 4], [["a", "p2"], 3], [["a", "p3"], 2],
                                                       [["r", "q"], 2]]))
    for name, inputs, seed, expected in runs:
        counts = None if expected is None else {tuple(key): n for key, n in expected}
        out = verl["process_validation_metrics"](inputs["data_sources"], inputs["sample_uids"], inputs["infos_dict"],
                                                 seed=seed, expected_acc_counts=counts)
        result = {src: {var: {m: float(v) for m, v in metrics.items()} for var, metrics in var2m.items()}
                  for src, var2m in out.items()}
        cases["process_validation_metrics"].append({"name": name, **inputs, "seed": seed,
                                                    "expected_acc_counts": expected, "result": result})
    OUT.write_text(json.dumps({"verl_version": "0.9.1", "metric_utils_sha256": digest, "numpy": np.__version__,
                               "made_by": Path(__file__).name, **cases}, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
