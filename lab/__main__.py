"""`python -m lab [--profile NAME]... [-- PYTEST ARGS]`: build (or reuse) the lab image, boot each host
profile in QEMU, run tests/hosts/ inside with the checkout and its virtualenv shared at the same paths,
bring back one JUnit report per profile and print a summary.

Exit status: 0 when every profile that ran passed (skipped profiles are printed as SKIPPED, never as
passed), 1 when a profile failed or its VM broke down, 2 for bad usage."""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from lab.errors import LabSkip
from lab.image import RECIPES, build_image, ensure_host_tools
from lab.profiles import PROFILES
from lab.report import ProfileResult, read_junit, summary_lines, write_skip_junit, write_summary
from lab.vm import run_profile

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "build" / "lab"
PROFILE_TIMEOUT_S = float(os.environ.get("REAMER_LAB_PROFILE_TIMEOUT", 1200))


class Interrupted(Exception):
    pass


def _on_signal(signum: int, _frame: object) -> None:
    raise Interrupted(signal.Signals(signum).name)


def interpreter_home(venv: Path) -> Path:
    """The directory of the CPython build the virtualenv was made from (pyvenv.cfg `home` is its bin/)."""
    cfg = venv / "pyvenv.cfg"
    for line in cfg.read_text().splitlines():
        key, _, value = line.partition("=")
        if key.strip() == "home":
            home = Path(value.strip())
            return home.parent if home.name == "bin" else home
    raise LabSkip(f"{cfg} names no `home` interpreter", "recreate the virtualenv: make clean install")


def shares_for(venv: Path) -> dict[str, Path]:
    shares = {"checkout": REPO, "pyhome": interpreter_home(venv)}
    for tag, path in shares.items():
        if any(c.isspace() for c in str(path)):
            raise LabSkip(f"the {tag} path {path} has white space, which the kernel command line cannot carry",
                          "move the checkout or the interpreter to a path without spaces")
    if str(shares["pyhome"]).startswith(str(REPO) + "/"):
        del shares["pyhome"]  # already inside the checkout share
    return shares


def build_models(out: Path, venv: Path) -> Path:
    """The tiny built-in model, made on the host (the VM sees it through the checkout share when `out` is
    inside the checkout, else through the report share): model building stays out of the slow VM."""
    model = out / "models" / "tiny.onnx"
    if not model.exists():
        model.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([str(venv / "bin" / "reamer"), "models", "build", "tiny", "--out", str(model)], check=True,
                       timeout=300, stdout=subprocess.DEVNULL)
    return model.parent


def result_for(profile: str, run, out_dir: Path) -> ProfileResult:
    junit = out_dir / "junit.xml"
    result = ProfileResult(profile, "error", boot_s=run.boot_s, wall_s=run.wall_s, report=str(junit))
    if junit.exists():
        result.passed, result.failed, result.errors, result.skipped, result.failures = read_junit(junit)
        ran = result.passed + result.failed + result.errors
        if result.failed or result.errors:
            result.status = "failed"
        elif ran == 0:
            result.status = "skipped"
            result.reason = "no test ran inside the VM (all skipped or deselected)"
        else:
            result.status = "passed"
    else:
        result.reason = run.error or f"the VM wrote no report (see {out_dir / 'job.log'} and console.log)"
    if run.timed_out:
        result.status = "error"
        result.reason = run.error
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lab", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", action="append", choices=sorted(PROFILES),
                        help="boot only this profile (repeatable); default: all")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help=f"reports, inside the checkout (default {DEFAULT_OUT})")
    parser.add_argument("--rebuild", action="store_true", help="rebuild the cached image")
    parser.add_argument("--venv", type=Path, default=REPO / ".venv")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments for inside the VM (after --)")
    args = parser.parse_args(argv)
    args.out = args.out.resolve()
    if not str(args.out).startswith(str(REPO) + "/"):
        parser.error("--out must be inside the checkout (the VM reads the models from the checkout share)")
    names = args.profile or list(PROFILES)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _on_signal)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    results: list[ProfileResult] = []
    log = args.out / "build.log"
    try:
        try:
            if sys.platform != "linux" or os.uname().machine != "x86_64":
                raise LabSkip(f"the lab emulates x86_64 Debian hosts and runs the host's x86_64 virtualenv inside; "
                              f"this host is {sys.platform}/{os.uname().machine}")
            shares = shares_for(args.venv)
            ensure_host_tools(log)
            images, broken = {}, {}
            for recipe in dict.fromkeys(PROFILES[name].image for name in names):
                t = time.monotonic()
                print(f"lab: image {recipe} (recipe-keyed cache, build log {log})", flush=True)
                try:
                    images[recipe] = image = build_image(log, rebuild=args.rebuild, recipe=RECIPES[recipe])
                except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
                    # One image that cannot be built (e.g. a suite the mirror or keyring lacks) fails only the
                    # profiles that boot it; the others still run.
                    broken[recipe] = f"image {recipe} could not be built: {exc}"
                    print(f"lab: {broken[recipe]}", flush=True)
                    continue
                print(f"lab: image {recipe} {image.directory} (kernel {image.kernel_version}) ready in "
                      f"{time.monotonic() - t:.0f} s", flush=True)
            models = build_models(args.out, args.venv)
        except LabSkip as skip:
            reason = skip.reason + (f" (fix: {skip.fix})" if skip.fix else "")
            for name in names:
                junit = args.out / name / "junit.xml"
                write_skip_junit(junit, name, reason)
                results.append(ProfileResult(name, "skipped", reason=reason, report=str(junit)))
            return _finish(results, args.out, started)
        for name in names:
            profile = PROFILES[name]
            out_dir = args.out / name
            if profile.image in broken:
                results.append(ProfileResult(name, "error", reason=broken[profile.image], report=str(log)))
                continue
            print(f"lab: booting {name} ({profile.description})", flush=True)
            run = run_profile(images[profile.image], profile, out_dir, shares, PROFILE_TIMEOUT_S, args.pytest_args,
                              {"REAMER_LAB_MODELS": str(models)})
            result = result_for(name, run, out_dir)
            results.append(result)
            print(f"lab: {name}: {result.status.upper()} in {run.wall_s:.0f} s", flush=True)
        return _finish(results, args.out, started)
    except (KeyboardInterrupt, Interrupted) as exc:
        print(f"lab: interrupted ({exc or 'SIGINT'}); no VM is left running", file=sys.stderr, flush=True)
        return 130


def _finish(results: list[ProfileResult], out: Path, started: float) -> int:
    total = time.monotonic() - started
    for line in summary_lines(results, total):
        print(line, flush=True)
    write_summary(out / "summary.json", results, total)
    return 1 if any(r.status in ("failed", "error") for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
