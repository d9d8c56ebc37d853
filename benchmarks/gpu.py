"""`python -m benchmarks gpu`: one prepared check of the CUDA path, run in a single call on a
machine lent with one GPU (the `device` tool: H100 or H200, torch 2.11 + CUDA 13 in its own
python, no hydra, omegaconf or wandb, nothing outside it reachable).

In order, each step timed, in a process of its own (a failing or hanging step does not stop
the next), its figures written to $OUT/gpu-check.json as soon as it ends:

    install      the carried wheels and the framework into the machine's python, beside its
                 torch (pip --no-index --no-deps --target): its torch is never touched
    environment  device, versions, a bf16 8192^3 matrix product's TFLOP/s, NCCL on one rank
    tests        the tests marked `gpu` (every test a GPU un-skips carries the mark)
    train        the default `train` as a user types it: backend, device, its summary line
    gpt          the GPT preset scaled to 42.8M parameters (bf16, then bf16 + torch.compile):
                 tokens/s, mfu and peak memory of `train` against a plain nanoGPT-style loop of
                 the same model, batch and precision, alternated in the same process; the goal
                 is >= 0.98x the plain loop's tokens/s, and the logged mfu equal to the one
                 computed by hand from the counted FLOPs and NVIDIA's datasheet peak
    sync         torch.cuda.set_sync_debug_mode("error") around steps 11-19 of `train`
    variants     precision=amp (GradScaler), comm=powersgd, strategy=fsdp; two ranks share the
                 one GPU over gloo (NCCL cannot put two ranks on one device)
    checkpoint   written on the GPU, resumed on the CPU, resumed on the GPU again: the loaded
                 state bit-exact each time

The call a session with a GPU makes (the `device` tool's `run`; budget: the script stops
starting steps after --budget seconds, 450 by default, and the whole call fits 8 minutes):

    command:   PYTHONUNBUFFERED=1 python3 -m benchmarks gpu --wheels .whl --out "$OUT"
    carry:     [".whl"]
    timeout_s: 540

A rerun of some steps on the same warm machine: add `--only gpt,sync` (the install runs again:
the machine's /tmp may be new). Build the wheel folder here first, once (pure-Python wheels,
versions from uv.lock; about 1 MB; .whl/ is git-ignored):

    uv run python -m benchmarks gpu --make-wheels .whl

The framework is installed with --no-deps, so pyproject.toml's pins do not stop it; the install
step lists every requirement the machine's packages do not meet (torch==2.13.0 against its
2.11 until the ranges admit torch 2.11 and torchvision 0.26).

The same steps at toy size on a CPU (a tiny GPT in fp32, gloo, mfu against
trainer.peak_tflops=1.0; `--variants fp32,fp32+compile` adds torch.compile, whose first
compile of even this GPT took 79 s on 2 shared cores), as tests/integration/test_gpu_check.py
runs them:

    uv run python -m benchmarks gpu --cpu --out /tmp/gpu-check
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from benchmarks.isolated import Report, run_forked, write_json

REPO = Path(__file__).resolve().parent.parent
STEPS = ("environment", "tests", "train", "gpt", "sync", "variants", "checkpoint")
# Each step's own limit in seconds; the call's --budget bounds them all together.
LIMITS = {
    "gpu": {
        "environment": 60,
        "tests": 150,
        "train": 120,
        "gpt": 240,
        "sync": 120,
        "variants": 150,
        "checkpoint": 120,
    },
    "cpu": {name: 900 for name in STEPS},
}
FEWEST_SECONDS = 20  # a step that would get less is not started
# What the machine lacks, pinned as uv.lock pins them, and what builds the framework there.
RUNTIME_WHEELS = (
    "hydra-core",
    "omegaconf",
    "antlr4-python3-runtime",
    "hydra-submitit-launcher",
    "submitit",
)
BUILD_WHEELS = (
    "hatchling==1.33.0",
    "packaging==26.3",
    "pathspec==1.1.1",
    "pluggy==1.7.0",
    "tomlkit==0.15.2",
    "trove-classifiers==2026.9.21.13",
)


def arguments(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks gpu",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--cpu", action="store_true", help="toy sizes on the CPU, CUDA hidden")
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(os.environ.get("OUT", REPO / "benchmarks/results/gpu-check")),
    )
    parser.add_argument("--wheels", type=Path, help="install these wheels and the framework first")
    parser.add_argument("--site", type=Path, default=Path(tempfile.gettempdir(), "framework-site"))
    parser.add_argument("--only", help=f"some of: {','.join(STEPS)}")
    parser.add_argument("--budget", type=float, help="seconds (default 450; --cpu: 1800)")
    parser.add_argument("--rounds", type=int, help="gpt: rounds per variant (default 3; --cpu 2)")
    parser.add_argument("--variants", help="gpt: default bf16,bf16+compile (--cpu: fp32)")
    parser.add_argument("--keep", action="store_true", help="keep the run dirs (printed)")
    parser.add_argument("--make-wheels", type=Path, metavar="DIR", help="build the wheels, exit")
    args = parser.parse_args(argv)
    unknown = set((args.only or "").split(",")) - {"", *STEPS}
    if unknown:
        parser.error(f"--only: no step {', '.join(sorted(unknown))}")
    return args


def main(argv: list[str]) -> None:
    args = arguments(argv)
    if args.make_wheels:
        make_wheels(args.make_wheels)
        return
    sys.exit(0 if run_check(args) else 1)


# --- the wheels --------------------------------------------------------------------------------
def locked_versions(names: tuple[str, ...], lock: Path = REPO / "uv.lock") -> dict[str, str]:
    packages = tomllib.loads(lock.read_text())["package"]
    found = {p["name"]: p["version"] for p in packages if p["name"] in names}
    missing = set(names) - found.keys()
    if missing:
        raise SystemExit(f"uv.lock pins no {', '.join(sorted(missing))}")
    return found


def make_wheels(folder: Path) -> None:
    """Pure-Python wheels of what the GPU machine lacks, into `folder` (emptied of wheels
    first). pip's `wheel` fetches a registry's wheel, or builds one from an sdist
    (antlr4-python3-runtime 4.9.3 ships no wheel)."""
    runtime = [f"{name}=={version}" for name, version in locked_versions(RUNTIME_WHEELS).items()]
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("*.whl"):
        old.unlink()
    pip = (
        [sys.executable, "-m", "pip"]
        if importlib.util.find_spec("pip")
        else ["uvx", "--from", "pip", "pip"]
    )
    command = [*pip, "wheel", "--no-deps", "--wheel-dir", str(folder), *runtime, *BUILD_WHEELS]
    subprocess.run(command, check=True)
    wheels = sorted(folder.glob("*.whl"))
    problems = wheel_problems([w.name for w in wheels])
    if problems:
        raise SystemExit("\n".join(problems))
    total = sum(w.stat().st_size for w in wheels)
    print("\n".join(w.name for w in wheels))
    print(f"{len(wheels)} wheels, {total / 1e6:.1f} MB in {folder}")


def wheel_problems(names: list[str]) -> list[str]:
    """A wheel that would not install on any CPython 3 on x86-64 (not pure Python), or two
    versions of one project (pip refuses the whole install then)."""
    problems, projects = [], {}
    for name in names:
        parts = name[: -len(".whl")].split("-")
        project, python, abi, platform_tag = parts[0].lower(), *parts[-3:]
        if abi != "none" or platform_tag != "any" or "py3" not in python.split("."):
            problems.append(f"{name} is not a pure-Python py3 wheel")
        projects.setdefault(project, []).append(name)
    problems += [f"two versions of {p}: {v}" for p, v in projects.items() if len(v) > 1]
    return problems


def build_wheel_names() -> set[str]:
    return {re.split(r"[=<>]", spec)[0].replace("-", "_") for spec in BUILD_WHEELS}


def install(wheels: Path, site: Path) -> tuple[bool, dict[str, Any]]:
    """The runtime wheels and the framework (built here by the carried hatchling) into `site`
    in one pip call (pip --target replaces a folder two calls both fill: hydra_plugins/), with
    --no-deps: nothing the machine has, torch above all, is touched."""
    files = sorted(wheels.glob("*.whl"))
    if not files:
        return False, {"error": f"no wheels in {wheels}: python -m benchmarks gpu --make-wheels"}
    build = {f for f in files if f.name.split("-")[0].lower() in build_wheel_names()}
    build_site = site.with_name(f"{site.name}-build")
    for folder in (site, build_site):
        shutil.rmtree(folder, ignore_errors=True)
    pip = [
        *(sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps"),
        *("--no-compile", "--no-cache-dir", "--disable-pip-version-check"),
    ]
    steps = [
        ([*pip, "--target", str(build_site), *map(str, sorted(build))], {}),
        (
            [*pip, "--no-build-isolation", "--target", str(site)]
            + [str(f) for f in files if f not in build]
            + [str(REPO)],
            {"PYTHONPATH": str(build_site)},  # the build backend, for this call only
        ),
    ]
    for command, env in steps:
        found = subprocess.run(
            command, capture_output=True, text=True, env={**os.environ, **env}, cwd=REPO
        )
        if found.returncode != 0:
            return False, {"command": " ".join(command), "error": _tail(found.stderr)}
    use_site(site)
    return True, installed_figures(files, site)


def use_site(site: Path) -> None:
    """`site` on this process's path (after the repository's root, whose framework is the
    same source) and on every child's PYTHONPATH."""
    sys.path.insert(1, str(site))
    importlib.invalidate_caches()
    os.environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(site), os.environ.get("PYTHONPATH")])
    )


def installed_figures(files: list[Path], site: Path) -> dict[str, Any]:
    from importlib import metadata

    empty = Path(tempfile.mkdtemp(prefix="empty-"))
    where = subprocess.run(
        [sys.executable, "-c", "import framework; print(framework.__file__)"],
        capture_output=True,
        text=True,
        cwd=empty,
    )
    return {
        "wheels": [f.name for f in files],
        "site": str(site),
        "framework_from_an_empty_folder": where.stdout.strip() or _tail(where.stderr),
        "torch": _version(metadata, "torch"),
        "torchvision": _version(metadata, "torchvision"),
        "requirements_unmet": unmet_requirements(site),
    }


def _version(metadata, name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def unmet_requirements(site: Path) -> list[str]:
    """The installed framework's requirements that this python's packages do not meet."""
    from importlib import metadata

    from packaging.requirements import Requirement

    framework = next(
        d for d in metadata.distributions(path=[str(site)]) if d.metadata["Name"] == "framework"
    )
    unmet = []
    for line in framework.requires or []:
        requirement = Requirement(line)
        if requirement.marker and not requirement.marker.evaluate({"extra": ""}):
            continue
        version = _version(metadata, requirement.name)
        if version is None:
            unmet.append(f"{requirement}: not installed")
        elif not requirement.specifier.contains(version, prereleases=True):
            unmet.append(f"{requirement}: {version} here")
    return unmet


# --- the check ---------------------------------------------------------------------------------
class Record:
    """gpu-check.json, rewritten after every step: a call cut off keeps what it found."""

    def __init__(self, path: Path, header: dict[str, Any]) -> None:
        self.path, self.data = path, {**header, "steps": []}

    def add(self, entry: dict[str, Any]) -> None:
        self.data["steps"].append(entry)
        self.data["ok"] = all(step["ok"] for step in self.data["steps"])
        self.save()

    def save(self) -> None:
        write_json(self.path, self.data)


def run_check(args: argparse.Namespace) -> bool:
    mode = "cpu" if args.cpu else "gpu"
    if args.cpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before torch is imported
        # One thread per process, as the other benchmarks' ranks: on 2 shared cores, two
        # threads each made the toy GPT's rates swing 10x between runs (train and plain alike).
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    started = time.monotonic()
    deadline = started + (args.budget or (1800 if args.cpu else 450))
    args.out.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    log = args.out / "gpu-check.log"
    log.write_text("")
    record = Record(args.out / "gpu-check.json", header(mode))
    print(f"GPU check ({mode}): writing {record.path}", flush=True)
    if args.wheels:
        ok, figures = install(args.wheels, args.site)
        seconds = time.monotonic() - started
        record.add(entry("install", ok, seconds, figures, None if ok else figures.get("error")))
        print(line(record.data["steps"][-1]), flush=True)
        if not ok:
            return finish(record, started, scratch, args.keep)
    from benchmarks import gpu_steps

    loading = time.monotonic()
    gpu_steps.preload()
    record.data["preload_s"] = round(time.monotonic() - loading, 1)
    settings = gpt_settings(args)
    site = str(args.site) if args.wheels else None
    prepared = gpu_steps.Check(scratch=scratch, site=site, **settings)
    names = [n for n in STEPS if not args.only or n in args.only.split(",")]
    for name in names:
        limit = min(LIMITS[mode][name], deadline - time.monotonic())
        outcome = run_step(name, prepared, limit, log)
        record.add(outcome)
        print(line(outcome), flush=True)
        if (
            name == "environment"
            and not args.cpu
            and outcome["figures"].get("cuda_available") is False
        ):
            for later in names[names.index(name) + 1 :]:
                record.add(entry(later, False, 0.0, {}, None, "no CUDA device is visible"))
            break
    return finish(record, started, scratch, args.keep)


def header(mode: str) -> dict[str, Any]:
    return {
        "check": "benchmarks/gpu.py",
        "mode": mode,
        "argv": sys.argv,
        "started": datetime.now(UTC).isoformat(timespec="seconds"),
        "host": {
            "python": platform.python_version(),
            "machine": platform.machine(),
            "cores": len(os.sched_getaffinity(0)),
        },
    }


def gpt_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The GPT step's work: ~43M parameters on a GPU, a toy on a CPU."""
    from benchmarks.plain_gpt import GPTWork

    if args.cpu:
        # The fewest steps that still give the steady windows after warm-up (three of two
        # steps); the final validation of one batch instead of the 46,513 characters (0.4 s
        # a run). A run's fixed costs are most of the step's time here: it proves the wiring.
        work = GPTWork(
            layers=2,
            heads=4,
            width=64,
            block_size=32,
            stride=32,
            batch_size=8,
            warmup=2,
            steps=6,
            log_every=2,
            peak_tflops=1.0,
            eval_batches=1,
        )
        variants, rounds = "fp32", 2  # bf16 autocast on these CPUs is about 16x slower
    else:
        work = GPTWork(
            layers=6,
            heads=12,
            width=768,
            block_size=256,
            stride=64,
            batch_size=64,
            warmup=10,
            steps=60,
            log_every=10,
        )
        variants, rounds = "bf16,bf16+compile", 3
    return {
        "cpu": args.cpu,
        "gpt": work,
        "variants": tuple((args.variants or variants).split(",")),
        "rounds": args.rounds or rounds,
    }


def run_step(name: str, prepared, limit: float, log: Path) -> dict[str, Any]:
    """One step in a forked process, at most `limit` seconds; its log appended to `log`."""
    from benchmarks import gpu_steps

    if limit < FEWEST_SECONDS:
        return entry(name, False, 0.0, {}, None, "the call's --budget is spent")
    step_log = prepared.scratch / f"{name}.log"
    deadline = time.monotonic() + limit

    def work(report: Report) -> dict[str, Any]:
        def partial(figures: dict[str, Any]) -> None:
            report({"ok": False, "figures": figures})

        ok, figures = gpu_steps.STEPS[name](gpu_steps.StepRun(prepared, deadline, partial))
        return {"ok": ok, "figures": figures}

    outcome = run_forked(work, step_log, limit)
    with log.open("a") as all_logs:
        all_logs.write(f"\n===== {name} =====\n")
        all_logs.write(
            step_log.read_text(errors="replace")[-2_000_000:] if step_log.exists() else ""
        )
    result = outcome.result or {}
    ok = outcome.finished and bool(result.get("ok"))
    return entry(name, ok, outcome.seconds, result.get("figures") or {}, outcome.error)


def entry(
    name: str,
    ok: bool,
    seconds: float,
    figures: dict[str, Any],
    error: str | None,
    not_run: str | None = None,
) -> dict[str, Any]:
    return {
        "name": name,
        "ok": ok,
        "seconds": round(seconds, 1),
        "figures": figures,
        "error": error,
        "not_run": not_run,
    }


def finish(record: Record, started: float, scratch: Path, keep: bool) -> bool:
    record.data["seconds"] = round(time.monotonic() - started, 1)
    record.data["finished"] = datetime.now(UTC).isoformat(timespec="seconds")
    record.save()
    if keep:
        print(f"run dirs kept in {scratch}")
    else:
        shutil.rmtree(scratch, ignore_errors=True)
    print(summary(record.data), flush=True)
    return record.data["ok"]


# --- what is printed ---------------------------------------------------------------------------
def line(step: dict[str, Any]) -> str:
    status = "ok" if step["ok"] else ("NOT RUN" if step["not_run"] else "FAILED")
    text = f"  {step['name']:<12} {status:<8} {step['seconds']:>6.1f} s  "
    text += step["not_run"] or describe(step["name"], step["figures"])
    if step["error"]:
        text += f"\n      error: {step['error'].strip().splitlines()[-1][:300]}"
    return text


def describe(name: str, figures: dict[str, Any]) -> str:
    """One step's figures in a line or a few."""
    try:
        return DESCRIBE.get(name, lambda f: "")(figures)
    except (KeyError, TypeError, ValueError, IndexError):
        return json.dumps(figures, default=str)[:300]


def _install(f: dict[str, Any]) -> str:
    unmet = "; ".join(f.get("requirements_unmet", [])) or "none"
    return f"framework from {f.get('framework_from_an_empty_folder')}; requirements unmet: {unmet}"


def _environment(f: dict[str, Any]) -> str:
    if not f.get("cuda_available"):
        return f"no CUDA; torch {f.get('torch')}, python {f.get('python')}"
    return (
        f"{f['device_name']} ({f['memory_gib']} GiB), torch {f['torch']} (CUDA {f['torch_cuda']}),"
        f" bf16 matmul {_num(f['bf16_matmul_tflops'])} TFLOP/s, NCCL one rank: {f['nccl_one_rank']}"
    )


def _tests(f: dict[str, Any]) -> str:
    counts = f.get("counts", {})
    failed = [k for k, v in f.get("outcomes", {}).items() if v.startswith("failed")]
    text = ", ".join(f"{v} {k}" for k, v in counts.items())
    return text + "".join(f"\n      {name}: {f['outcomes'][name]}" for name in failed)


def _train(f: dict[str, Any]) -> str:
    return (
        f"backend={f.get('backend')} device={f.get('device')} ranks={f.get('world_size')} "
        f"({f.get('command_s')} s as a command)\n      {f.get('summary_line')}"
    )


def _gpt(f: dict[str, Any]) -> str:
    text = (
        f"{f['work']['layers']} layers x {f['work']['width']}, {f['tokens_per_step']} tokens/step,"
        f" {f['flops_per_step_counted']:.4g} FLOPs/step counted"
        f" ({f['analytic_over_counted']:.3f}x by nanoGPT's formula), peak {f['peak_tflops']}"
        f" TFLOP/s ({f['peak_source']}; the framework's table: {f['framework_table_peak_tflops']})"
    )
    for variant, v in f["variants"].items():
        text += (
            f"\n      {variant:<13} train {_median_text(v['train_tokens_per_s'])} tokens/s, plain "
            f"{_median_text(v['plain_tokens_per_s'])}: {v.get('ratio', float('nan')):.3f}x "
            f"(rounds {v.get('round_ratios')}; goal >= 0.98: {v.get('goal_met')}); mfu logged "
            f"{_num(v.get('train_mfu_logged'))}, by hand {_num(v.get('train_mfu_by_hand'))} "
            f"(plain {_num(v.get('plain_mfu_by_hand'))}); peak memory train "
            f"{_num(v['train_peak_memory_mib'])} MiB, plain {_num(v['plain_peak_memory_mib'])} MiB"
        )
    return text


def _sync(f: dict[str, Any]) -> str:
    cases = "; ".join(
        f"{name}: {'no sync' if c['ok'] else c.get('error') or c.get('reads') or c['window']}"
        for name, c in f["cases"].items()
    )
    return f"{f['how']}, steps {f['steps_watched'][0]}-{f['steps_watched'][1]}: {cases}"


def _variants(f: dict[str, Any]) -> str:
    text = f"two ranks: {f['two_ranks']}"
    for name, c in f["cases"].items():
        if "error" in c:
            text += f"\n      {name}: FAILED {c['error'].splitlines()[-1][:200]}"
            continue
        extra = {k: _num(v) for k, v in c.items() if k.startswith(("precision/", "comm/"))}
        text += (
            f"\n      {name}: {'ok' if c['ok'] else 'FAILED ' + '; '.join(c['problems'])} "
            f"backend={c['backend']} device={c['device']} ranks={c['world_size']} "
            f"loss {_num(c['losses'][0])} -> {_num(c['losses'][-1])} {extra}"
        )
    return text


def _checkpoint(f: dict[str, Any]) -> str:
    legs = " -> ".join(f"{leg.get('device')} {leg.get('steps')}" for leg in f["legs"])
    differences = [d for leg in f["legs"] for d in leg.get("differences") or []]
    carried = sorted({d.split(":")[0] for leg in f["legs"] for d in leg.get("not_carried") or []})
    return (
        f"{legs} steps: {len(differences)} differences in the loaded state"
        f"{' (' + '; '.join(differences[:5]) + ')' if differences else ''}; "
        f"not carried across the CPU: {', '.join(carried) or 'nothing'}"
    )


DESCRIBE = {
    "install": _install,
    "environment": _environment,
    "tests": _tests,
    "train": _train,
    "gpt": _gpt,
    "sync": _sync,
    "variants": _variants,
    "checkpoint": _checkpoint,
}


def _median_text(values: list[float]) -> str:
    import statistics

    return f"{statistics.median(values):.4g}" if values else "-"


def _num(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, int | float) else str(value)


def summary(data: dict[str, Any]) -> str:
    environment = next((s for s in data["steps"] if s["name"] == "environment"), {})
    device = environment.get("figures", {}).get("device_name", "no GPU")
    passed = sum(step["ok"] for step in data["steps"])
    lines = [
        f"\nGPU check ({data['mode']}, {device}), {data.get('seconds')} s: "
        f"{passed}/{len(data['steps'])} steps ok",
        *(line(step) for step in data["steps"]),
    ]
    return "\n".join(lines)


def _tail(text: str, lines: int = 20) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])
