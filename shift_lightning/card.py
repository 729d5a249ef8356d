"""Model cards: the ``README.md`` (the Hub's format: YAML metadata, then markdown) of every saved folder.

A card says what the folder holds and how it was made: the base model, which blocks were removed and
by which criterion, the repair (solver) and its parameter count, the calibration data and its size,
the recovery, the evaluation the run made (zero-shot, perplexity, closeness to the original), the
command, and the license, inherited from the base model (:func:`base_model_info`; ``other`` with a
note when it cannot be determined). What the run did not measure is said, not invented.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from .maps.keptfit_knobs import refit_damping

#: Embedded offline models: name -> (Hub id of the weights, license, description).
EMBEDDED = {"smollm2-135m": ("HuggingFaceTB/SmolLM2-135M-Instruct", "apache-2.0",
                             "SmolLM2-135M-Instruct (Q4_1 GGUF, de-quantised)"),
            "gemma3-270m": ("google/gemma-3-270m", "gemma", "Gemma 3 270M (Q4_K_M GGUF, de-quantised)")}
#: Hub id prefixes whose whole family has one license.
HUB_LICENSES = (("HuggingFaceTB/SmolLM2", "apache-2.0"), ("google/gemma-3", "gemma"), ("google/gemma-2", "gemma"),
                ("meta-llama/Llama-3.1", "llama3.1"), ("meta-llama/Meta-Llama-3.1", "llama3.1"),
                ("meta-llama/Llama-3.2", "llama3.2"), ("meta-llama/Llama-3.3", "llama3.3"),
                ("meta-llama/Meta-Llama-3-", "llama3"))



def describe(solver: str) -> str:
    """One line on what ``solver`` put in the model (the registry's description)."""
    from .maps.solvers import SOLVERS

    return "no repair" if solver == "none" else getattr(SOLVERS.get(solver), "description", "") or solver


@dataclass
class CardFacts:
    """What the writer knows besides the model and its record (all optional)."""

    command: str | None = None
    """The command that made the folder (``python calibrate.py …``); ``None``: made from Python."""
    calibration: dict | None = None
    """The calibration report (``calibration_report.json``): data, tokens, evaluation, parameters."""
    recovery: dict | None = None
    """The recovery report (``recovery_report.json``): method, steps, metrics before / after."""
    role: str | None = None
    """What this folder is within its run (e.g. the corrected base of a PEFT adapter)."""


@dataclass
class BaseInfo:
    name: str
    hub_id: str | None
    license: str
    note: str | None = None


#: What the built-in text sources are, for readers of a card who do not have this repo at hand.
_SOURCE_NOTES = {
    "mixed": " (Wikipedia lead sections, CoQA stories and SciQ / Social IQa / CommonsenseQA question-answer "
             "text; shift-lightning's `corpora.mixed`)",
    "wiki_summaries": " (Wikipedia lead sections, CC BY-SA)",
}


def _front_matter_license(readme: Path) -> str | None:
    try:
        import yaml

        text = readme.read_text()
        if text.startswith("---"):
            meta = yaml.safe_load(text.split("---", 2)[1])
            lic = meta.get("license") if isinstance(meta, dict) else None
            return str(lic) if lic else None
    except Exception:  # an unreadable card is the same as none
        return None
    return None


def _gguf_license(path: Path) -> str | None:
    try:
        from gguf import GGUFReader

        field = GGUFReader(str(path)).fields.get("general.license")
        return str(field.contents()) if field is not None else None
    except Exception:
        return None


def base_model_info(base: Any) -> BaseInfo:
    """Name, Hub id and license of the unpruned model a record names (a name, a ``ModelConfig``
    dict, or ``{"tiny": …}``)."""
    if isinstance(base, dict):
        if base.get("tiny") is not None:
            return BaseInfo(f"a tiny random {base['tiny'].get('family', 'llama')} model (tests)", None, "other",
                            "a randomly initialised test model: no upstream license")
        base = base.get("name_or_path")
    if not base:
        return BaseInfo("unknown", None, "other", "the base model is not recorded: check its license yourself")
    name = str(base)
    if name in EMBEDDED:
        hub, lic, desc = EMBEDDED[name]
        return BaseInfo(f"`{name}`: {desc}", hub, lic)
    p = Path(name).expanduser()
    lic = _gguf_license(p) if name.endswith(".gguf") and p.is_file() else \
        _front_matter_license(p / "README.md") if p.is_dir() else None
    hub = None
    if not p.exists() and name.count("/") == 1:
        hub = name
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(name, "README.md")
            lic = _front_matter_license(Path(cached)) if isinstance(cached, str) else None
        except Exception:
            lic = None
        lic = lic or next((v for prefix, v in HUB_LICENSES if name.startswith(prefix)), None)
    if lic:
        return BaseInfo(f"`{name}`", hub, lic)
    return BaseInfo(f"`{name}`", hub, "other", "the base model's license could not be determined here: the base "
                                                "model's own license applies; check it before sharing")


def base_model_name(base: Any) -> Any:
    """A record's ``base_model`` as a full folder keeps it: the name, or ``{"tiny": …}``."""
    if isinstance(base, dict):
        return {"tiny": base["tiny"]} if base.get("tiny") is not None else base.get("name_or_path")
    return base


def _yaml(meta: dict) -> str:
    lines = []
    for k, v in meta.items():
        if isinstance(v, list):
            lines += [f"{k}:"] + [f"- {json.dumps(x)}" for x in v]
        else:
            lines.append(f"{k}: {json.dumps(v)}")
    return "\n".join(lines)


def _params(model: nn.Module | None) -> tuple[int, int, int]:
    """(adapters, ReplaceMe maps kept as modules, their parameters) of ``model``."""
    from .maps.surgery import adapter_set, branch_maps

    if model is None:
        return 0, 0, 0
    sites = adapter_set(model)
    n_a = len(sites.sites) if sites is not None else 0
    p = sum(t.numel() for t in sites.parameters()) if sites is not None else 0
    maps = branch_maps(model)
    return n_a, len(maps), p + sum(m.map.weight.numel() for m in maps.values())


def evaluation_table(evals: dict[str, dict]) -> list[str]:
    """Markdown rows comparing variants (original / pruned / pruned+lra) on tasks, perplexity and
    closeness to the original (``kl`` / ``top1`` per set, where measured)."""
    variants = list(evals)
    tasks = sorted({t for e in evals.values() for t in e.get("tasks", {})})
    ppls = sorted({p for e in evals.values() for p in e.get("perplexity", {})})
    rows = ["| metric | " + " | ".join(variants) + " |", "|---" * (len(variants) + 1) + "|"]
    for t in tasks:
        first = next(e["tasks"][t] for e in evals.values() if t in e.get("tasks", {}))
        vals = [f"{100 * e['tasks'][t]['value']:.2f}" if t in e.get("tasks", {}) else "" for e in evals.values()]
        rows.append(f"| {t} ({first['metric']}, n={first['n']}) | " + " | ".join(vals) + " |")
    if tasks:
        rows.append("| average | " + " | ".join(f"{100 * e['average']:.2f}" if e.get("average") is not None else ""
                                             for e in evals.values()) + " |")
    for p in ppls:
        first = next(e["perplexity"][p] for e in evals.values() if p in e.get("perplexity", {}))
        vals = [f"{e['perplexity'][p]['ppl']:.4g}" if p in e.get("perplexity", {}) else "" for e in evals.values()]
        rows.append(f"| PPL {p} ({first['tokens']} tokens) | " + " | ".join(vals) + " |")
    sets = sorted({k for e in evals.values() for k in e.get("kl", {})})
    for k in sets:
        f = next(e["closeness"][k] for e in evals.values() if k in e.get("kl", {}))
        rows.append(f"| KL(original ‖ model) {k} ({f['positions']} positions) | "
                    + " | ".join(f"{e['kl'][k]:.4f}" if k in e.get("kl", {}) else "" for e in evals.values()) + " |")
        rows.append(f"| top-1 agreement {k} | "
                    + " | ".join(f"{100 * e['top1'][k]:.2f}" if k in e.get("top1", {}) else "" for e in evals.values())
                    + " |")
    return rows


def _recovery_rows(rec: dict) -> list[str]:
    before, after = rec.get("metrics_before", {}), rec.get("metrics_after", {})
    keys = [k for k in ("val/ppl", "val/kl", "val/top1", "zeroshot/avg") if k in before or k in after]
    keys += sorted(k for k in set(before) | set(after) if k.startswith("zeroshot/") and k not in keys
                   and k.count("/") == 1)
    if not keys:
        return []
    fmt = lambda v: "" if v is None else f"{v:.4g}"  # noqa: E731
    return ["| recovery metric | before | after |", "|---|---|---|"] + \
        [f"| {k} | {fmt(before.get(k))} | {fmt(after.get(k))} |" for k in keys]


def model_card(spec: dict, model: nn.Module | None, facts: CardFacts | None = None, title: str | None = None,
               loads_remotely: bool = False) -> str:
    """The card of a folder whose record is ``spec`` (``shift_config.json`` as a dict)."""
    facts = facts or CardFacts()
    cal, rec = facts.calibration or {}, facts.recovery or {}
    base = base_model_info(spec.get("base_model") or cal.get("model"))
    n, removed = spec["original_num_layers"], spec["pruned_layers"]
    solver = spec.get("solver") or "none"
    rows, n_adapters = _what_was_done(spec, model, facts, base)
    short = base.hub_id.split("/")[-1] if base.hub_id else base.name.strip("`").split("`")[0]
    title = title or f"{short}, {len(removed)} of {n} blocks removed" + (f", repaired: {solver}" if solver != "none" else "")
    out = ["---", _yaml(_metadata(base, n_adapters)), "---", "", f"# {title[:1].upper() + title[1:]}", "",
           f"{base.name[:1].upper() + base.name[1:]} with {len(removed)} of its {n} decoder blocks removed"
           + (f" and repaired with {describe(solver)}" if solver != "none" else "")
           + ", made with shift-lightning (SHIFT-LLM).", "",
           "## What was done", "", "| | |", "|---|---|", *[f"| {k} | {v} |" for k, v in rows], "", "## Evaluation", ""]
    evals = cal.get("evaluation") or {}
    if evals:
        out += ["Measured by the calibration run (zero-shot: lm-evaluation-harness 0.4.13 prompts and scoring; "
                "closeness: next-token KL(original ‖ model) and top-1 agreement):", "", *evaluation_table(evals), ""]
    rrows = _recovery_rows(rec)
    if rrows:
        out += ["Measured during recovery (validation windows; zero-shot on the configured doc subset):", "", *rrows, ""]
    if not evals and not rrows:
        out += ["This run measured no zero-shot accuracy, perplexity or closeness to the original. Evaluate it with "
                "`python evaluate.py --model.name_or_path <this folder> …` or lm-evaluation-harness (below).", ""]
    out += [*_use(loads_remotely), "## Runs in", "", runtimes(spec, model, loads_remotely), "", "## License", "",
            f"Inherited from the base model: `{base.license}`." + (f" Note: {base.note}." if base.note else ""), ""]
    return "\n".join(out)


def _metadata(base, n_adapters: int) -> dict[str, Any]:
    """The card's YAML header (license, base model, tags)."""
    meta: dict[str, Any] = {"license": base.license}
    if base.license == "other":
        meta["license_name"] = "base-model-license"
    if base.hub_id:
        meta["base_model"] = base.hub_id
    meta.update(library_name="transformers", pipeline_tag="text-generation",
                tags=["shift-lightning", "depth-pruning", "pruned"] + (["linear-residual-adapter"] if n_adapters else []))
    return meta


def _what_was_done(spec: dict, model, facts: CardFacts, base) -> tuple[list[tuple[str, str]], int]:
    """The "What was done" table's rows, and the number of adapters."""
    cal, rec = facts.calibration or {}, facts.recovery or {}
    n, removed = spec["original_num_layers"], spec["pruned_layers"]
    solver = spec.get("solver") or "none"
    n_a, n_m, p = _params(model)
    total = sum(t.numel() for t in model.parameters()) if model is not None else None
    repair = f"`{solver}`: {describe(solver)}"
    if n_a or n_m:
        repair += f"; {n_a} adapter(s)" + (f", {n_m} map(s) on a post-MLP norm" if n_m else "") + \
            f", {p:,} parameters" + (f" ({100 * p / total:.2f} % of the model)" if total else "")
    elif solver.startswith("replaceme"):
        repair += "; folded into each map's `mlp.down_proj`: no extra parameters"
    rows = [("base model", base.name + (f" ([{base.hub_id}](https://huggingface.co/{base.hub_id}))" if base.hub_id
                                        and base.hub_id not in base.name else "")),
            ("blocks removed", f"{len(removed)} of {n}: `{removed}`, chosen by `{spec.get('criterion') or 'explicit list'}`"),
            ("repair", repair)]
    if (cal.get("refit") or {}).get("kept"):
        rows.append(("kept blocks re-fitted", f"`{cal['refit']['kept']}` (original indices): their linear layers "
                     "re-fitted in closed form to absorb the stream's drift (relative damping "
                     f"{refit_damping(cal['calibration'])}); weights differ from the base model's there"))
    if cal.get("data"):
        d = cal["data"]
        rows.append(("calibration data", f"`{d.get('source')}`{_SOURCE_NOTES.get(d.get('source'), '')}: "
                     f"{d.get('num_samples')} × {d.get('seq_len')} tokens "
                     f"({cal.get('calibration_tokens', 0):,} tokens)" + (f"; held-out {cal['heldout_tokens']:,} tokens"
                                                                         if cal.get("heldout_tokens") else "")))
    if rec:
        r = rec.get("recovery", {})
        rows.append(("recovery", f"`{r.get('method')}`" + (f" (LoRA r={r.get('lora_r')}, alpha={r.get('lora_alpha')})"
                                                            if r.get("method") == "lora" else "")
                     + (", LRAs trained" if r.get("train_lra") or r.get("method") == "lra" else "")
                     + f"; {rec.get('steps')} steps, {rec.get('trainable_params', 0):,} trainable parameters, "
                     f"{rec.get('train_windows')} windows × {rec.get('train_tokens_per_window')} tokens"))
    if total is not None:
        rows.append(("parameters", (f"{cal['params_before']:,} → " if cal.get("params_before") else "") + f"{total:,}"))
    if facts.role:
        rows.append(("this folder", facts.role))
    rows.append(("made by", f"`{facts.command}`" if facts.command else "Python (see `config.yaml` if present)"))
    return rows, n_a


def _use(loads_remotely: bool) -> list[str]:
    """The card's "Use" section."""
    out = ["## Use", "", "```python", "import shift_lightning",
           "model, tok = shift_lightning.load_pretrained(\"<this folder>\")   # no remote code", "```", ""]
    if loads_remotely:
        out += ["With transformers alone (runs this folder's `modeling_shift.py`):", "", "```python",
                "from transformers import AutoModelForCausalLM, AutoTokenizer",
                "model = AutoModelForCausalLM.from_pretrained(\"<this folder>\", trust_remote_code=True)",
                "tok = AutoTokenizer.from_pretrained(\"<this folder>\", trust_remote_code=True)", "```", "",
                "Without `trust_remote_code=True` transformers refuses the folder: loaded as a stock model it would "
                "lack its adapters.", ""]
    return out + ["lm-evaluation-harness: `python -m shift_lightning.lmeval --model shift --model_args "
                  "pretrained=<this folder> --tasks arc_easy`", ""]


def runtimes(spec: dict, model, loads_remotely: bool) -> str:
    """Which runtimes can run the folder (the card's "Runs in")."""
    family = getattr(getattr(model, "config", None), "model_type", "its family's")
    if spec.get("weights") == "adapters":
        return ("`shift_lightning.load_pretrained` only: this folder holds the maps, not the model's weights (it "
                "rebuilds them from the base model it names).")
    if loads_remotely:
        return ("`shift_lightning.load_pretrained`, and transformers with `trust_remote_code=True`. Not llama.cpp or "
                "vLLM: its adapters act on the residual stream, which no weight of a stock model can carry. For a "
                "folder stock runtimes run, calibrate with `--calibration.solver stock` (Llama-layout families).")
    return (f"A plain `{family}` folder (no custom code): `AutoModelForCausalLM.from_pretrained(\"<this folder>\")` "
            "gives the same logits as `shift_lightning.load_pretrained`; `python -m shift_lightning.recipes.gguf "
            "--model <this folder> --out model.gguf --outtype q8_0` writes a GGUF for llama.cpp (tested on "
            "Llama-layout and pruned Gemma3 folders); vLLM loads folders of this layout (not tested by shift-lightning).")


def peft_card(adapter_config: dict, base_dir: str, spec: dict, facts: CardFacts | None = None) -> str:
    """The card of a PEFT adapter folder written by a LoRA recovery, on top of the corrected base."""
    facts = facts or CardFacts()
    info = base_model_info(spec.get("base_model"))
    meta = {"license": info.license, "library_name": "peft", "tags": ["shift-lightning", "depth-pruning", "lora"]}
    if info.license == "other":
        meta["license_name"] = "base-model-license"
    rows = [("LoRA", f"r={adapter_config.get('r')}, alpha={adapter_config.get('lora_alpha')}, on "
                     f"`{sorted(adapter_config.get('target_modules') or [])}`"),
            ("trained LRAs (modules_to_save)", f"`{adapter_config.get('modules_to_save') or []}`"),
            ("corrected base", f"`{base_dir}` (pruned + repaired, before recovery)"),
            ("original model", info.name),
            ("made by", f"`{facts.command}`" if facts.command else "Python")]
    rec = facts.recovery or {}
    out = ["---", _yaml(meta), "---", "", "# LoRA recovery adapter (PEFT)", "",
           "The recovery's LoRA (and the Linear Residual Adapters it trained) as a PEFT adapter, on top of the "
           "corrected base model. The merged model is the folder above.", "", "| | |", "|---|---|",
           *[f"| {k} | {v} |" for k, v in rows], "", *(_recovery_rows(rec) + [""] if _recovery_rows(rec) else []),
           "## Use", "", "```python", "import shift_lightning", "from peft import PeftModel",
           f"base, tok = shift_lightning.load_pretrained(\"{base_dir}\")",
           "model = PeftModel.from_pretrained(base, \"<this folder>\")   # == the merged model; merge_and_unload() works",
           "```", "", "## License", "", f"Inherited from the base model: `{info.license}`."
           + (f" Note: {info.note}." if info.note else ""), ""]
    return "\n".join(out)
