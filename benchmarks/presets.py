"""The experiment presets as users run them: `train experiment=<name>` on 2 CPU ranks, each
result next to a baseline computed on the same split.

    uv run python -m benchmarks presets [--presets digits_cnn,diabetes_mlp,digits_vae,char_gpt]

- digits_cnn: val/accuracy (chance: 10%).
- diabetes_mlp: val/r2 against scikit-learn's LinearRegression fit on the same training split.
- digits_vae: val/elbo at the end against its value at the first evaluation.
- char_gpt: val/bits_per_char against the validation text's unigram entropy (the best a model
  without context can do).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import REPO, table, write_result

PRESETS = ("digits_cnn", "diabetes_mlp", "digits_vae", "char_gpt")
MAIN = {
    "digits_cnn": "val/accuracy",
    "diabetes_mlp": "val/r2",
    "digits_vae": "val/elbo",
    "char_gpt": "val/bits_per_char",
}


def baseline(preset: str, run_dir: Path) -> tuple[str, float]:
    """What the preset's result is compared with, on the same data split."""
    if preset == "diabetes_mlp":
        from sklearn.linear_model import LinearRegression
        from sklearn.metrics import r2_score

        from framework.components.data import diabetes
        from framework.config.registry import option_values

        splits = diabetes(**option_values("data", "diabetes"))
        (features, targets), (val_features, val_targets) = splits.train.tensors, splits.val.tensors
        fit = LinearRegression().fit(features.numpy(), targets.numpy())
        return "linear regression R²", float(
            r2_score(val_targets.numpy(), fit.predict(val_features.numpy()))
        )
    if preset == "char_gpt":
        from framework.components.data import text, unigram_entropy
        from framework.config.registry import option_values

        val = text(**option_values("data", "text")).val
        return "unigram entropy (bits/char)", unigram_entropy(bytes(val.tokens.tolist()).decode())
    if preset == "digits_vae":
        events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return "val/elbo at the first evaluation", next(
            e["val/elbo"] for e in events if "val/elbo" in e
        )
    return "chance", 0.1


def run(preset: str, run_dir: Path) -> dict[str, Any]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    started = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-m", "framework.cli", f"experiment={preset}", f"hydra.run.dir={run_dir}"],
        cwd=REPO,
        env=env,
        text=True,
        capture_output=True,
    )
    command_s = time.perf_counter() - started
    if result.returncode != 0:
        raise RuntimeError(f"{preset} failed:\n{result.stderr[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    name, value = baseline(preset, run_dir)
    return {
        "summary": summary,
        "command_s": command_s,
        "baseline": name,
        "baseline_value": value,
        "artifacts": sorted(p.name for p in run_dir.iterdir() if p.suffix in (".png", ".txt")),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks presets", description=__doc__)
    parser.add_argument("--presets", default=",".join(PRESETS))
    args = parser.parse_args(argv)
    scratch = Path(tempfile.mkdtemp(prefix="presets-bench-"))
    results = {}
    for preset in args.presets.split(","):
        results[preset] = run(preset, scratch / preset)
        print(
            f"{preset}: {MAIN[preset]}={results[preset]['summary'][MAIN[preset]]:.4f} "
            f"({results[preset]['command_s']:.0f} s)",
            flush=True,
        )
    rows = [
        [
            f"`{preset}`",
            f"{MAIN[preset]} = **{r['summary'][MAIN[preset]]:.4f}**",
            f"{r['baseline']}: {r['baseline_value']:.4f}",
            str(r["summary"]["steps"]),
            f"{r['summary']['wall_s']:.0f} s",
            f"{r['command_s']:.0f} s",
            ", ".join(r["artifacts"]),
        ]
        for preset, r in results.items()
    ]
    headers = [
        "preset",
        "result",
        "baseline (same split)",
        "steps",
        "training loop",
        "whole command",
        "pictures and text in the run dir",
    ]
    print(table(headers, rows))
    record = {"results": results, "table": {"headers": headers, "rows": rows}}
    write_result("presets", record)
    return record
