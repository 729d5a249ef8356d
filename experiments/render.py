"""Re-render every committed table in ``results/`` from its run files, without running anything.

    make tables                                  # = python -m experiments.render: in place
    python -m experiments.render --check         # render into a scratch copy, compare with the committed files
    python -m experiments.render --out /tmp/t    # render into /tmp/t/results (a copy of results/)

Each table is remade by its own tool's render-only path (``--render_only`` of the grids, the render functions of
the cross-grid tables, the checks that read JSON only), with the arguments of the command that made it
(``results/README.md``; a table made with special arguments is rendered with them). :func:`jobs` is the one list
of them, in the order they depend on each other (the closeness tables before the targets that read them).
:data:`NOT_RENDERED` names every committed ``.md`` under ``results/`` that no job remakes, and why (hand-written
READMEs; tables written by a script only while it runs a model). ``--check`` fails when a rendered ``.md`` or
``.json`` differs from the committed one, or when a committed ``.md`` is neither rendered nor excepted; PNG plots
are rendered too but not compared (their bytes depend on matplotlib; ``--no_plots``: tables only).

``--out DIR`` copies ``results/`` to ``DIR/results`` and renders there (the tools name their inputs and outputs
relative to the repository root, and some record those paths in the tables, so the copy keeps that layout).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import logging
import os
import shlex
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = "results"
CHECKS = ROOT / "experiments" / "checks"  # the checks are scripts (``import _common``), not package modules
COMPARED = (".md", ".json")  # what --check compares byte for byte (PNGs: rendered, not compared)


@dataclass(frozen=True)
class Job:
    """One render: ``tool``'s ``main(args)`` (a module under ``experiments``, or ``checks/<script>``)."""

    tool: str
    args: tuple[str, ...] = ()

    def __str__(self) -> str:
        script = self.tool.startswith("checks/")
        head = f"python experiments/{self.tool}.py" if script else f"python -m experiments.{self.tool}"
        return " ".join([head, *(shlex.quote(a) for a in self.args)])

    def main(self):
        if self.tool.startswith("checks/"):
            if str(CHECKS) not in sys.path:
                sys.path.insert(0, str(CHECKS))
            return importlib.import_module(self.tool.split("/", 1)[1]).main
        return importlib.import_module(f"experiments.{self.tool}").main


def _grid(model: str, *args: str) -> Job:
    return Job("reproduce", ("--model", model, *args, "--render_only"))


#: Variants of the mixed grid (``results/paper_mixed``), in its tables' order.
MIXED_VARIANTS = "[pruned, lra, lra_span, lra_anchored, lra_auto, lra_replaceme, lra_replaceme_anchored, " \
                 "lra_replaceme_auto, replaceme, replaceme_cosine, guarded, guarded_span, guarded_joint, stock]"
#: The re-fit grid's criteria, in the order it ran them (its table's row order).
REFIT_CRITERIA = "[ppl, angular, linear_fit, taylor, magnitude_l2, block_influence, random, magnitude_l1, " \
                 "reverse_star, reverse]"
#: The repairs with a closeness table of their own (``closeness_table --repair R``), besides the default's.
CLOSENESS_REPAIRS = ("lra_span", "lra_anchored", "lra_auto", "lra_replaceme", "lra_replaceme_anchored",
                     "lra_replaceme_auto", "guarded_span", "guarded_joint", "stock")
_MIXED_GRID = ("--grid.calib_source", "mixed", "--grid.out", "results/paper_mixed")


def _closeness_tables() -> list[Job]:
    from experiments.closeness_table import ClosenessTableConfig

    base = ClosenessTableConfig().out  # the default repair's table; the others are named after it
    return [Job("closeness_table")] + [Job("closeness_table", ("--repair", r, "--out", f"{base}_{r}"))
                                       for r in CLOSENESS_REPAIRS]


def jobs() -> list[Job]:
    """Every render, in dependency order (each job reads run files and, for the targets, the closeness tables)."""
    return [
        # grids: results/<grid>/<model>.{md,json,png}
        _grid("smollm2-135m"),
        _grid("gemma3-270m"),
        *(_grid(m, "--calib_source", "mixed", "--out", "results/paper_mixed", "--pruned_from", "results/paper",
                "--variants", MIXED_VARIANTS if m == "smollm2-135m" else MIXED_VARIANTS.replace(", stock]", "]"))
          for m in ("smollm2-135m", "gemma3-270m")),  # stock refuses Gemma3 (its post-branch norms cannot fold)
        _grid("smollm2-135m", "--calib_source", "mixed", "--variants", "[lra_replaceme, stock]", "--refit_kept", "2",
              "--criteria", REFIT_CRITERIA, "--out", "results/paper_mixed_refit", "--pruned_from", "results/paper"),
        Job("ablations", ("--model", "smollm2-135m", "--render_only")),
        *(Job("closeness_sweep", ("--model", m, "--criteria", "[reverse_star, angular, taylor, block_influence, "
                                  "reverse, random, magnitude_l1, magnitude_l2, ppl, linear_fit, linear_fit_kl]",
                                  "--repairs", repairs, "--render_only"))
          for m, repairs in (("smollm2-135m", "[pruned, lra, guarded]"), ("gemma3-270m", "[pruned, lra]"))),
        # comparisons between grids
        Job("domain_compare", ("--model", "smollm2-135m")),
        Job("domain_compare", ("--model", "gemma3-270m")),
        Job("domain_compare", ("--model", "smollm2-135m", "--a", "results/paper_mixed", "--b",
                               "results/paper_mixed_refit", "--repairs", "[lra_replaceme]", "--a_label", "joint map",
                               "--b_label", "+ re-fit", "--title", "Kept-block re-fit", "--differs",
                               "the second grid re-fitted the kept blocks after each map", "--pruned_from",
                               "results/paper")),
        Job("compare_runs", ("--a", "results/paper/smollm2-135m", "--b", "results/device_check/smollm2-135m_h200",
                             "--out", "results/device_check/smollm2-135m_cpu_vs_h200")),
        # tables across the grids
        *_closeness_tables(),
        Job("targets_summary"),
        Job("robust_vs_kl"),
        # recovery: the arguments each folder's recovery.json records
        Job("recovery_table", ("--model", "smollm2-135m", "--steps", "50", "--render_only")),
        Job("recovery_table", ("--model", "smollm2-135m", "--steps", "200", "--criteria", "[angular]",
                               "--runs", "[lra_lora_kd, lora_kd]", "--out", "results/recovery_kd200",
                               "--render_only")),
        Job("recovery_table", ("--model", "smollm2-135m", "--criteria", "[angular]", "--repair", "lra_span",
                               "--train_source", "mixed", "--runs", "[lra_lora_kd, lra_trained_lora_kd, lora_kd]",
                               "--steps", "200", *_MIXED_GRID, "--out", "results/recovery_kd200_mixed",
                               "--render_only")),
        Job("recovery_table", ("--model", "smollm2-135m", "--criteria", "[angular]", "--repair", "lra_span",
                               "--train_source", "mixed", "--runs", "[lra_lora_kd]", "--lr", "0.002", "--steps",
                               "100", *_MIXED_GRID, "--out", "results/recovery_kd100_lr2e-3_mixed", "--render_only")),
        Job("recovery_table", ("--model", "smollm2-135m", "--criteria", "[angular]", "--repair", "lra_span",
                               "--train_source", "mixed", "--runs", "[lra_lora_kd]", "--lr", "0.002", "--lora_r", "32",
                               "--lora_alpha", "64", "--steps", "100", *_MIXED_GRID,
                               "--out", "results/recovery_kd100_lr2e-3_r32_mixed", "--render_only")),
        Job("recovery_table", ("--model", "smollm2-135m", "--criteria", "[ppl]", "--repair", "lra_replaceme",
                               "--train_source", "mixed", "--runs", "[lra_lora_kd]", "--steps", "200", *_MIXED_GRID,
                               "--out", "results/recovery_kd200_mixed_default", "--render_only")),
        Job("recovery_table", ("--model", "smollm2-135m", "--criteria", "[angular]", "--repair", "lra_span",
                               "--train_source", "mixed", "--runs", "[lra_lora_kd]", "--steps", "500",
                               "--train_samples", "2000", "--val_every", "100", *_MIXED_GRID,
                               "--out", "results/recovery_kd500_fresh_mixed", "--render_only")),
        # the price after recovery: one folder per repair, the parent's table across them
        Job("recovery_table", ("--model", "smollm2-135m", "--criteria", "[angular, reverse_star]", "--repair", "stock",
                               "--grid.refit_kept", "2", "--train_source", "mixed", "--runs", "[lra_lora_kd]", "--steps",
                               "200", "--grid.calib_source", "mixed", "--grid.out", "results/paper_mixed_refit",
                               "--out", "results/recovery_price/stock_refit2", "--render_only")),
        *(Job("recovery_table", ("--model", "smollm2-135m", "--criteria", "[angular, reverse_star]", "--repair", repair,
                                 "--train_source", "mixed", "--runs", "[lra_trained_lora_kd]", "--steps", "200",
                                 "--grid.calib_source", "mixed", "--grid.out", "results/paper_mixed_refit",
                                 "--out", f"results/recovery_price/{repair}", "--render_only"))
          for repair in ("lra_replaceme",)),
        Job("recovery_table", ("--out", "results/recovery_price", "--render_only")),
        # research checks that render from their JSON (the others run a model: NOT_RENDERED)
        Job("checks/kd_plateau"),
        *(Job("checks/replaceme_cosine_check", ("--model", m, "--criterion", c, "--render_only"))
          for m, c in (("smollm2-135m", "angular"), ("gemma3-270m", "ppl"))),
        *(Job("checks/refit_check", ("--out", f"results/bench/{name}", "--render_only"))
          for name in ("refit_smollm2-135m", "refit_smollm2-135m_w256", "refit_smollm2-135m_w512",
                       "refit_gemma3-270m")),
        Job("checks/stock_check", ("--model", "smollm2-135m", "--render_only")),
    ]


_RUNS_A_MODEL = "written by the script while it runs a model (no render-only path)"
#: Committed ``.md`` files under ``results/`` that no job remakes, and why.
NOT_RENDERED = {
    "results/README.md": "hand-written index",
    **{f"results/llama_cpp/{n}.md": "written by llama_cpp_check.py while it runs llama.cpp and the model"
       for n in ("tiny-llama", "smollm2-135m", "smollm2-135m-stock-reverse_star", "smollm2-135m-stock-reverse_star-kvf32",
                 "gemma3-270m-blocks6-11", "gemma3-270m-blocks7-10-unchecked", "gemma3-270m-blocks7-10",
                 "gemma3-270m-blocks7-10-kvf32", "smollm2-135m-kvf32", "smollm2-135m-kvf32-flash",
                 "smollm2-135m-stock-lora-kvf32", "smollm2-135m-stock-lora-kvf32-flash")},
    "results/llama_cpp/tokenizer_smollm2.md": "written by llama_cpp_tokenizer.py while it runs llama.cpp's tokenizer",
    "results/eval/README.md": "hand-written",
    "results/paper_r10/README.md": "hand-written (the grid's tables are not committed)",
    "results/eval/smollm2-135m/eval_results.md": "written by evaluate.py with its scores (no render-only path)",
    "results/eval/gemma3-270m/eval_results.md": "written by evaluate.py with its scores (no render-only path)",
    "results/criteria_smollm2.md": _RUNS_A_MODEL,
    "results/criteria_lra_smollm2.md": _RUNS_A_MODEL,
    "results/damping_smollm2.md": _RUNS_A_MODEL,
    "results/bench/gram_cpu.md": "a timing benchmark (benchmarks/gram.py): written while it measures",
    **{f"results/bench/{n}.md": _RUNS_A_MODEL for n in (
        "anchored_check_gemma3", "anchored_check_joint_gemma3", "anchored_check_joint_smollm2",
        "anchored_check_smollm2",
        "auto_cost_joint_smollm2", "auto_cost_smollm2", "auto_cost_smollm2_one_span", "guard_cost_smollm2",
        "span_cost_smollm2", "joint_cost_gemma3_taylor_angular_2_repeats", "joint_cost_gemma3_taylor_one_gemm", "joint_cost_gemma3_taylor_angular_3_repeats",
        "joint_cost_gemma3_taylor_angular_shared_cores", "joint_cost_gemma3_taylor", "joint_cost_smollm2_with_lra_span", "joint_cost_smollm2_taylor_angular_shared_cores",
        "joint_cost_smollm2_taylor", "fidelity_topk_smollm2", "linear_fit_check_smollm2",
        "linearpatch_check_gemma3-270m_angular", "linearpatch_check_gemma3-270m_ppl",
        "linearpatch_check_smollm2-135m_reverse_star", "low_rank_gemma3-270m_angular",
        "low_rank_smollm2-135m_angular", "low_rank_smollm2-135m_taylor", "richer_maps_gemma3-270m_angular",
        "richer_maps_smollm2-135m_angular")},
}


#: Committed files whose rendered numbers differ from the committed ones in the last digits only (float noise of
#: another machine's numpy), with why; --check compares them as numbers (relative 1e-9), not as bytes. They are
#: not re-committed from this machine: the numbers are the committed run's.
FLOAT_NOISE = {
    "results/robust_vs_kl.json": "the κ fits and the sweep's predictions (numpy reductions over 2,800 grid points) "
                                 "differ from the committed ones by ~1e-13 relative on this machine",
}


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_ino, p.stat().st_mtime_ns)
            for p in (root / RESULTS).rglob("*") if p.is_file()}


@contextlib.contextmanager
def _cwd(path: Path):
    old = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)


@contextlib.contextmanager
def _without_matplotlib():
    """``import matplotlib`` fails for the length of the ``with``: every tool then skips its plot (matplotlib is
    optional to them), and writes its tables as usual; their "matplotlib not installed" warnings are muted."""
    import lightning.pytorch  # noqa: F401  (it and torchmetrics import matplotlib themselves: loaded before it is hidden)

    saved = {k: v for k, v in sys.modules.items() if k == "matplotlib" or k.startswith("matplotlib.")}
    sys.modules["matplotlib"] = None  # type: ignore[assignment]
    logging.disable(logging.WARNING)
    try:
        yield
    finally:
        logging.disable(logging.NOTSET)
        del sys.modules["matplotlib"]
        sys.modules.update(saved)


def render(root: Path = ROOT, quiet: bool = False, plots: bool = True) -> dict[Job, list[str]]:
    """Run every job with ``root`` (a folder holding ``results/``) as the working folder; returns, per job, the
    files under ``results/`` it wrote (paths relative to ``root``). ``plots=False``: no PNG (a third of the time)."""
    root = Path(root).resolve()
    written: dict[Job, list[str]] = {}
    with _cwd(root), (contextlib.nullcontext() if plots else _without_matplotlib()):
        before = _snapshot(root)
        for job in jobs():
            t0 = time.time()
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                try:
                    job.main()(list(job.args))
                except SystemExit as e:
                    if e.code not in (0, None):
                        raise RuntimeError(f"{job} failed (exit {e.code})") from e
            after = _snapshot(root)
            written[job] = sorted(p for p, s in after.items() if before.get(p) != s)
            before = after
            if not quiet:
                print(f"{time.time() - t0:5.1f} s  {job}\n         -> {', '.join(written[job]) or 'nothing'}",
                      flush=True)
    return written


def copy_results(dest: Path, src: Path = ROOT) -> Path:
    """``src/results`` copied to ``dest/results`` (which must not exist yet); returns ``dest``."""
    dest = Path(dest)
    if (dest / RESULTS).exists():
        raise SystemExit(f"error: {dest / RESULTS} exists; --out needs a folder without results/ in it")
    if (dest / RESULTS).resolve().is_relative_to((src / RESULTS).resolve()):
        raise SystemExit(f"error: --out {dest} lies inside {src / RESULTS}")
    shutil.copytree(src / RESULTS, dest / RESULTS)
    return dest


def committed_tables(root: Path = ROOT) -> list[str]:
    """Every ``.md`` under ``root/results``, relative to ``root``."""
    return sorted(str(p.relative_to(root)) for p in (root / RESULTS).rglob("*.md"))


def differences(rendered: Path, committed: Path = ROOT) -> list[str]:
    """The ``.md`` / ``.json`` files under ``rendered/results`` whose bytes differ from ``committed/results``."""
    from experiments.harness import json_close
    out = []
    for p in sorted((rendered / RESULTS).rglob("*")):
        if p.suffix in COMPARED and p.is_file():
            rel = p.relative_to(rendered)
            ref = committed / rel
            if not ref.exists():
                out.append(str(rel))
            elif ref.read_bytes() != p.read_bytes() and not (
                    str(rel) in FLOAT_NOISE and json_close(json.loads(ref.read_text()), json.loads(p.read_text()))):
                out.append(str(rel))
    return out


def check(out: Path | None = None, quiet: bool = False, plots: bool = True) -> list[str]:
    """Render into a copy of ``results/`` (``out``, else a scratch folder); the problems found: rendered files
    that differ from the committed ones, committed tables that no job renders and :data:`NOT_RENDERED` does not
    excuse, and jobs that wrote nothing. PNGs are not compared (``plots=False``: not rendered either)."""
    with contextlib.ExitStack() as stack:
        dest = Path(out) if out else Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="tables-")))
        written = render(copy_results(dest), quiet=quiet, plots=plots)
        problems = [f"differs from the committed file: {p}" for p in differences(dest)]
        rendered = {p for ps in written.values() for p in ps}
        problems += [f"no render job and not in NOT_RENDERED: {p}" for p in committed_tables()
                     if p not in rendered and p not in NOT_RENDERED]
        problems += [f"rendered, yet listed in NOT_RENDERED: {p}" for p in NOT_RENDERED if p in rendered]
        problems += [f"wrote nothing: {j}" for j, ps in written.items() if not ps]
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="render into a copy and compare .md / .json with results/")
    ap.add_argument("--out", default=None, help="render into OUT/results (a copy of results/) instead of in place")
    ap.add_argument("--no_plots", action="store_true", help="tables only, no PNG plots (faster)")
    ap.add_argument("--quiet", action="store_true")
    a = ap.parse_args(argv)
    if a.check:
        problems = check(a.out, a.quiet, not a.no_plots)
        for p in problems:
            print(p)
        print(f"{len(problems)} problem(s)" if problems else "every committed table re-renders identically")
        return 1 if problems else 0
    root = copy_results(Path(a.out)) if a.out else ROOT
    written = render(root, a.quiet, not a.no_plots)
    print(f"{len(written)} render jobs, {sum(map(len, written.values()))} files written under {root / RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
