"""A stock pruned folder in llama.cpp: exported with llama.cpp's own converter, compared with transformers.

    python experiments/checks/llama_cpp_check.py --model smollm2-135m               # blocks 12-18 of 30 removed, no repair
    python experiments/checks/llama_cpp_check.py --model tiny                       # random Llama, 1 of 4 blocks removed
    python experiments/checks/llama_cpp_check.py --folder outputs/stock --name smollm2-135m-stock   # any saved folder

``--model`` prunes an embedded model (``smollm2-135m``: ``--layers``, default 12-18, 7 of 30 blocks, 23 %; no repair)
or a tiny random Llama (``tiny``: hidden 64, 4 blocks, the real SmolLM2 tokenizer and its 49,152-token vocabulary;
block 2 removed) and saves it with :func:`shift_lightning.checkpoint.save_pretrained` (a plain HF folder).
``--folder`` takes a folder saved already (e.g. one repaired with ``--calibration.solver stock``); a folder with
adapters is refused by the export, in one line. For each ``--formats`` (default f32, f16, q8_0) the folder is
exported with :func:`shift_lightning.export.gguf.export_gguf` (its layer metadata checked), loaded with
``llama_cpp.Llama(..., logits_all=True)`` and compared with ``shift_lightning.load_pretrained(folder)`` in float32:

* greedy continuations: ``--new_tokens`` (16) tokens after each of ``--prompts`` (20) prompts, the first
  ``--prompt_len`` (32) tokens of held-out wiki-summaries documents (the ``heldout`` split: never calibration
  text); identical token for token or not, and where they part the transformers logit margin there;
* next-token distributions on ``--windows`` (8) held-out windows of ``--seq_len`` (128) tokens: KL(HF ‖ llama.cpp)
  per token (nats, mean and max), top-1 agreement, both perplexities.

Both sides get the same token ids (the HF tokenizer's); whether llama.cpp's own tokenizer gives the same ids for
the prompts' documents is recorded too. Results: ``<out>/<name>.json`` and ``.md`` (default ``results/llama_cpp``).
llama-cpp-python 0.3.36 is imported if installed, else installed from a wheel cached in
``~/.cache/shift_lightning/llama_cpp`` (into a folder there, not into the environment), built there once with
``pip wheel`` when missing (:func:`ensure_llama_cpp`).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _common as C  # noqa: F401 (the repository root on sys.path, third-party tips quiet)

import numpy as np
import torch

from shift_lightning.errors import ShiftError
from shift_lightning.export.gguf import GGUFError, check_folder, check_layer_metadata, export_gguf, find_converter, run_converter
from shift_lightning.export.gguf_converter import LLAMA_CPP_PYTHON, SDIST, llama_cpp_cache
from shift_lightning.outputs import write_json_atomic, write_text_atomic

ROOT = Path(__file__).resolve().parents[2]
#: How the cached wheel is built: no examples, tests, server or curl; AVX2 / FMA / F16C rather than ``-march=native``
#: (a native build on a VM whose CPU reports AVX-512 and AMX it does not let a process run died of SIGILL in the first
#: ``llama_decode``; the check measures agreement, not speed).
CMAKE_ARGS = ("-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF "
              "-DGGML_AMX_INT8=OFF -DGGML_AMX_TILE=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF "
              "-DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF -DGGML_OPENMP=OFF")
SMOLLM2_LAYERS = list(range(12, 19))
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=49152, max_position_embeddings=512)
TINY_LAYERS = [2]


# --------------------------------------------------------------------------------------------
# llama-cpp-python
# --------------------------------------------------------------------------------------------
def _site() -> Path:
    return llama_cpp_cache() / f"site-py{sys.version_info.major}{sys.version_info.minor}-{LLAMA_CPP_PYTHON}"


def _pip(args: list[str], what: str, log: Path | None = None, env: dict | None = None) -> None:
    r = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True, env=env)
    text = (r.stdout or "") + (r.stderr or "")
    if log is not None:
        log.write_text(text)
    if r.returncode != 0:
        tail = "\n".join(text.strip().splitlines()[-15:])
        raise ShiftError(f"{what} failed (pip exit status {r.returncode}){f'; log: {log}' if log else ''}:\n{tail}")


def build_wheel(cache: Path) -> Path:
    """``pip wheel`` of the cached llama-cpp-python sdist (fetched first if missing) into ``cache``; one build at
    a time (a lock file); about 1.5 h on 2 busy cores here."""
    import fcntl

    from shift_lightning.export.gguf import find_converter

    if importlib.util.find_spec("scikit_build_core") is None:
        raise ShiftError("Building llama-cpp-python needs scikit-build-core: pip install scikit-build-core cmake")
    find_converter()  # fetches the sdist into the cache when it is missing
    with open(cache / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        found = sorted(cache.glob(f"llama_cpp_python-{LLAMA_CPP_PYTHON}-*.whl"))
        if found:  # built by another process while we waited
            return found[-1]
        log = cache / f"build-{os.getpid()}.log"
        sys.stderr.write(f"llama_cpp_check: building llama-cpp-python {LLAMA_CPP_PYTHON} once (log: {log}) …\n")
        _pip(["wheel", "--no-deps", "--no-build-isolation", "--disable-pip-version-check", "-w", str(cache),
              str(cache / SDIST)], f"Building llama-cpp-python {LLAMA_CPP_PYTHON}", log,
             {**os.environ, "CMAKE_ARGS": CMAKE_ARGS})
    found = sorted(cache.glob(f"llama_cpp_python-{LLAMA_CPP_PYTHON}-*.whl"))
    if not found:
        raise ShiftError(f"pip wheel ran but left no llama_cpp_python-{LLAMA_CPP_PYTHON}-*.whl in {cache}")
    return found[-1]


def ensure_llama_cpp():
    """``llama_cpp`` (llama-cpp-python): the installed one, else the one installed from the cached wheel into
    :func:`_site` (built once when the cache lacks it), put first on ``sys.path``."""
    try:
        import llama_cpp

        return llama_cpp
    except ImportError:
        pass
    site = _site()
    if not (site / "llama_cpp" / "__init__.py").is_file():
        cache = llama_cpp_cache()
        cache.mkdir(parents=True, exist_ok=True)
        wheels = sorted(cache.glob(f"llama_cpp_python-{LLAMA_CPP_PYTHON}-*.whl")) or [build_wheel(cache)]
        tmp = Path(tempfile.mkdtemp(prefix=".site-", dir=cache))
        try:
            extra = [] if importlib.util.find_spec("diskcache") else ["diskcache>=5.6.1"]
            _pip(["install", "--no-deps", "--disable-pip-version-check", "-q", "--target", str(tmp), str(wheels[-1]),
                  *extra], f"Installing {wheels[-1].name} into {site}")
            try:
                os.rename(tmp, site)
            except OSError:
                if not (site / "llama_cpp" / "__init__.py").is_file():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    import llama_cpp

    return llama_cpp


# --------------------------------------------------------------------------------------------
# The folder
# --------------------------------------------------------------------------------------------
def make_folder(model: str, out: Path, layers: list[int] | None = None) -> tuple[Path, dict]:
    """Prune ``model`` (``smollm2-135m`` or ``tiny``) of ``layers`` without repair and save it at ``out``."""
    from shift_lightning.checkpoint import load_pretrained, save_pretrained
    from shift_lightning.models import build_tiny_model
    from shift_lightning.maps.surgery import remove_blocks

    if model == "tiny":
        _, tok = load_pretrained("smollm2-135m")  # the real tokenizer (and the vocabulary size below)
        m, _ = build_tiny_model("llama", bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                pad_token_id=tok.pad_token_id, **TINY)
        layers = layers or TINY_LAYERS
        source = {"model": "tiny random Llama (seed 0)", **TINY, "tokenizer": "smollm2-135m"}
    else:
        m, tok = load_pretrained(model, dtype="float32")
        layers = layers or (SMOLLM2_LAYERS if model == "smollm2-135m" else None)
        if not layers:
            raise SystemExit(f"--layers is required for --model {model}")
        source = {"model": model}
    n = m.config.num_hidden_layers
    remove_blocks(m, layers)
    save_pretrained(m, tok, out, {"original_num_layers": n, "pruned_layers": layers, "base_model": source["model"],
                                  "criterion": "explicit", "solver": "none"})
    return out, {**source, "original_num_layers": n, "pruned_layers": layers}


# --------------------------------------------------------------------------------------------
# Text
# --------------------------------------------------------------------------------------------
def heldout_prompts(tok, n: int, prompt_len: int, bos: bool, seed: int = 0) -> tuple[list[list[int]], list[str]]:
    """The first ``prompt_len`` tokens of ``n`` held-out wiki-summaries documents (seeded order, documents of at
    least twice that length), and those documents' first 400 characters (the tokenizer check)."""
    import random

    from shift_lightning.sources import wiki_summaries

    docs = wiki_summaries("heldout")
    order = list(range(len(docs)))
    random.Random(seed).shuffle(order)
    prompts, texts = [], []
    for i in order:
        ids = tok(docs[i], add_special_tokens=False)["input_ids"]
        if len(ids) < 2 * prompt_len:
            continue
        prompts.append(([tok.bos_token_id] if bos else []) + ids[:prompt_len - int(bos)])
        texts.append(docs[i][:400])
        if len(prompts) == n:
            break
    return prompts, texts


#: Short texts where pre-tokenizers part: blank lines and indentation before digits, runs of spaces and tabs,
#: numbered lists, figures with separators (each a case llama.cpp's tokenizer was seen to split otherwise).
CRAFTED = ("Steps:\n\n1. Open the file.\n2. Close it.\n\n3. Done.", "Item\n\n0. zero", "x\n\n\n3 y",
           "a\t7\tb\t\t8", "In 1990,  42 people and   7 dogs", "Total: 1,234.56\n\n  99% of 2024",
           "    return 10\n\n\n    x = 2", "v2.0.1-rc3 (2024-12-07)\n\n\t12:30")


def tokenizer_probes(texts: list[str]) -> dict[str, list[str]]:
    """Texts to tokenize with both tokenizers: the prompts' held-out documents, real code (the first 1,500
    characters of five Python standard-library modules: indentation, blank lines, numbers) and :data:`CRAFTED`."""
    import difflib
    import inspect
    import json as json_module
    import string
    import textwrap

    code = [inspect.getsource(m)[:1500] for m in (json_module, textwrap, argparse, string, difflib)]
    return {"held-out documents": list(texts), "Python source": code, "newlines, spaces and numbers": list(CRAFTED)}


def compare_tokenizers(llm, tok, probes: dict[str, list[str]]) -> dict:
    """Per group of texts: how many llama.cpp's own tokenizer (``Llama.tokenize``) encodes to transformers' ids,
    and the first few places where they part (the text there, both runtimes' next ids)."""
    out = {}
    for name, group in probes.items():
        same, examples = 0, []
        for t in group:
            a = tok(t, add_special_tokens=False)["input_ids"]
            b = llm.tokenize(t.encode("utf-8"), add_bos=False, special=False)
            if a == b:
                same += 1
                continue
            k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            if len(examples) < 3:
                examples.append({"at": tok.decode(a[max(0, k - 2):k + 2]), "hf": a[k:k + 3], "llama_cpp": b[k:k + 3]})
        out[name] = {"identical": same, "texts": len(group), "examples": examples}
    return out


def heldout_windows(tok, model_type: str, n: int, seq_len: int) -> torch.Tensor:
    from shift_lightning.data import TextDataConfig, build_windows

    w = build_windows(TextDataConfig(source="wiki_summaries", split="heldout", num_samples=n, seq_len=seq_len, seed=1),
                      tok, model_type, "--windows")
    assert bool(w.attention_mask.all()), "packed windows have no padding"
    return w.input_ids


# --------------------------------------------------------------------------------------------
# The two runtimes
# --------------------------------------------------------------------------------------------
@torch.no_grad()
def hf_greedy(model, ids: list[int], new: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and, at each step, the margin between the top two logits."""
    import warnings

    warnings.filterwarnings("ignore", message=".*past_key_values.*")  # transformers 5.2x renames it; both work
    out = model(torch.tensor([ids]), use_cache=True)
    gen, margins = [], []
    for step in range(new):
        logits = out.logits[0, -1].double()
        top = torch.topk(logits, 2)
        gen.append(int(top.indices[0]))
        margins.append(float(top.values[0] - top.values[1]))
        if step + 1 < new:
            out = model(torch.tensor([[gen[-1]]]), past_key_values=out.past_key_values, use_cache=True)
    return gen, margins


def llama_greedy(llm, ids: list[int], new: int) -> list[int]:
    llm.reset()
    llm.eval(ids)
    gen = []
    for step in range(new):
        gen.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        if step + 1 < new:
            llm.eval([gen[-1]])
    return gen


@torch.no_grad()
def hf_logprobs(model, windows: torch.Tensor) -> list[torch.Tensor]:
    return [torch.log_softmax(model(w[None]).logits[0].double(), -1) for w in windows]


def llama_logprobs(llm, windows: torch.Tensor) -> list[torch.Tensor]:
    out = []
    for w in windows:
        llm.reset()
        llm.eval(w.tolist())
        out.append(torch.log_softmax(torch.from_numpy(np.array(llm.scores[: len(w)], dtype=np.float64)), -1))
    return out


def compare_logprobs(ref: list[torch.Tensor], got: list[torch.Tensor], windows: torch.Tensor) -> dict:
    """KL(ref ‖ got) per predicted token (nats), top-1 agreement, both perplexities over the windows."""
    kls, agree, nll_ref, nll_got = [], [], [], []
    for p, q, w in zip(ref, got, windows):
        kls.append((p.exp() * (p - q)).sum(-1))
        agree.append(p.argmax(-1) == q.argmax(-1))
        nxt = w[1:, None]
        nll_ref.append(-p[:-1].gather(-1, nxt)[:, 0])
        nll_got.append(-q[:-1].gather(-1, nxt)[:, 0])
    kl, top1 = torch.cat(kls), torch.cat(agree).double()
    return {"kl_mean": float(kl.mean()), "kl_max": float(kl.max()), "kl_p99": float(kl.quantile(0.99)),
            "top1_agree": float(top1.mean()), "ppl_hf": float(torch.cat(nll_ref).mean().exp()),
            "ppl_llama_cpp": float(torch.cat(nll_got).mean().exp()), "tokens": int(kl.numel())}


# --------------------------------------------------------------------------------------------
# The check
# --------------------------------------------------------------------------------------------
def run_check(folder: str | Path | None = None, model: str | None = None, name: str | None = None,
              formats: tuple[str, ...] = ("f32", "f16", "q8_0"), layers: list[int] | None = None,
              prompts: int = 20, prompt_len: int = 32, new_tokens: int = 16, windows: int = 8, seq_len: int = 128,
              out_dir: str | Path = ROOT / "results" / "llama_cpp", work: str | Path | None = None,
              llama_cpp: str | None = None, threads: int | None = None, unchecked: bool = False,
              command: str | None = None, kv_f32: bool = False, flash_attn: bool = False) -> dict:
    """Export ``folder`` (or ``model`` pruned into a work folder) in each format, compare llama.cpp with
    transformers on it, write ``<out_dir>/<name>.json`` and ``.md``; returns the JSON document. ``unchecked``: run the
    converter alone (no layer metadata check) and record what the check says instead of refusing the file, to
    measure what llama.cpp does with a file the export refuses. ``flash_attn``: llama.cpp's flash attention
    (llama-cpp-python's default is off; llama.cpp's own tools default to ``-fa auto``, on where the backend has it,
    which includes the CPU)."""
    from shift_lightning.checkpoint import load_pretrained
    from shift_lightning.data import wants_bos

    if (folder is None) == (model is None):
        raise SystemExit("give exactly one of --folder and --model")
    lc = ensure_llama_cpp()
    t_all = time.time()
    own_work = work is None
    work = Path(tempfile.mkdtemp(prefix="llama_cpp_check-")) if own_work else Path(work)
    work.mkdir(parents=True, exist_ok=True)
    try:
        if folder is None:
            folder, source = make_folder(model, work / f"{model}-pruned", layers)
            name = name or ("tiny-llama" if model == "tiny" else model)
        else:
            folder = Path(folder).expanduser()
            check_folder(folder)  # a folder with adapters is refused before anything is loaded
            spec_file = folder / "shift_config.json"
            spec = json.loads(spec_file.read_text()) if spec_file.is_file() else {}
            source = {"folder": str(folder), **{k: spec[k] for k in ("base_model", "original_num_layers",
                                                                      "pruned_layers", "solver") if k in spec}}
            name = name or folder.name
        ref, tok = load_pretrained(folder, dtype="float32")
        ref.eval()
        cfg = ref.config
        bos = wants_bos(tok, cfg.model_type)
        ps, texts = heldout_prompts(tok, prompts, prompt_len, bos)
        wins = heldout_windows(tok, cfg.model_type, windows, seq_len)
        t0 = time.time()
        hf_gen = [hf_greedy(ref, p, new_tokens) for p in ps]
        ref_lp = hf_logprobs(ref, wins)
        hf_seconds = time.time() - t0
        del ref
        n_ctx = max(seq_len, prompt_len + new_tokens)
        threads = threads or max(1, (os.cpu_count() or 2) // 2)  # llama-cpp-python's own default
        rows = {}
        tokenizer_same = tokenizers = None
        for fmt in formats:
            path = work / f"{name}-{fmt}.gguf"
            t0 = time.time()
            refusal = None
            if unchecked:
                path.unlink(missing_ok=True)
                run_converter(find_converter(llama_cpp), folder, path, fmt)
                try:
                    check_layer_metadata(path, cfg.num_hidden_layers, source.get("original_num_layers"),
                                         getattr(cfg, "layer_types", None))
                except GGUFError as e:
                    refusal = str(e).replace(str(path), path.name)
            else:
                export_gguf(folder, path, fmt, llama_cpp=llama_cpp, overwrite=True)
            export_s = time.time() - t0
            from gguf import GGUFReader

            meta = GGUFReader(str(path)).fields
            block_count = int(meta[f"{meta['general.architecture'].contents()}.block_count"].contents())
            kv = {"type_k": 0, "type_v": 0} if kv_f32 else {}  # GGML_TYPE_F32; default: its f16 cache
            llm = lc.Llama(model_path=str(path), logits_all=True, n_ctx=n_ctx, n_batch=n_ctx, n_threads=threads,
                           seed=0, verbose=False, flash_attn=flash_attn, **kv)
            if tokenizer_same is None:
                tokenizers = compare_tokenizers(llm, tok, tokenizer_probes(texts))
                tokenizer_same = tokenizers["held-out documents"]["identical"]
            t0 = time.time()
            ll_gen = [llama_greedy(llm, p, new_tokens) for p in ps]
            ll_lp = llama_logprobs(llm, wins)
            ll_seconds = time.time() - t0
            del llm
            diverged = []
            for i, ((g, margins), h) in enumerate(zip(hf_gen, ll_gen)):
                if g != h:
                    k = next(j for j in range(new_tokens) if g[j] != h[j])
                    diverged.append({"prompt": i, "at": k, "hf_margin": round(margins[k], 5)})
            rows[fmt] = {"file_mb": round(path.stat().st_size / 1e6, 2), "block_count": block_count,
                         **({"export_refused": refusal} if unchecked else {}), "export_s": round(export_s, 1),
                         "greedy_identical": len(ps) - len(diverged), "greedy_prompts": len(ps), "diverged": diverged,
                         **compare_logprobs(ref_lp, ll_lp, wins), "llama_cpp_s": round(ll_seconds, 1)}
            path.unlink()
    finally:
        if own_work:
            shutil.rmtree(work, ignore_errors=True)
    doc = {"name": name, "source": source, "num_hidden_layers": cfg.num_hidden_layers, "model_type": cfg.model_type,
           "llama_cpp_python": getattr(lc, "__version__", "?"), "llama_cpp_module": str(Path(lc.__file__).parent),
           "llama_cpp_library": str(getattr(importlib.import_module("llama_cpp.llama_cpp"), "_base_path", "?")),
           "converter": "convert_hf_to_gguf.py of "
           + (str(llama_cpp) if llama_cpp else f"llama-cpp-python {LLAMA_CPP_PYTHON}'s vendored llama.cpp"),
           "settings": {"prompts": len(ps), "prompt_len": prompt_len, "new_tokens": new_tokens, "windows": windows,
                        "seq_len": seq_len, "bos": bos, "text": "wiki-summaries, heldout split (no calibration text)",
                        "reference": "shift_lightning.load_pretrained(folder), float32, transformers",
                        "threads": threads, "kv_cache": "f32" if kv_f32 else "f16",
                        "flash_attn": "on" if flash_attn else "off"},
           "tokenizer_identical": f"{tokenizer_same}/{len(texts)}", "tokenizers": tokenizers,
           "hf_s": round(hf_seconds, 1),
           "formats": rows, "seconds": round(time.time() - t_all, 1),
           "machine": {"python": platform.python_version(), "torch": torch.__version__, "cpu_count": os.cpu_count()},
           "command": command or command_line(folder if "folder" in source else None, model, name, formats, layers)}
    out_dir = Path(out_dir)
    write_json_atomic(out_dir / f"{name}.json", doc, indent=2)
    write_text_atomic(out_dir / f"{name}.md", render(doc))
    return doc


def command_line(folder, model, name, formats, layers) -> str:
    parts = ["python experiments/checks/llama_cpp_check.py"]
    parts += [f"--folder {folder}"] if folder else [f"--model {model}"]
    if layers:
        parts.append(f"--layers {','.join(map(str, layers))}")
    if formats != ("f32", "f16", "q8_0"):
        parts.append(f"--formats {','.join(formats)}")
    return " ".join(parts + ([f"--name {name}"] if folder else []))


def _blocks(ids: list[int]) -> str:
    from shift_lightning.export.gguf import _ranges

    return f"block{'s' if len(ids) > 1 else ''} {_ranges(sorted(ids))}"


def render(doc: dict) -> str:
    s, src = doc["settings"], doc["source"]
    what = (f"`{src['folder']}`" if "folder" in src else src["model"])
    pruned = src.get("pruned_layers")
    solver = src.get("solver") or src.get("correction")  # results written before the key was renamed
    lines = [f"# {doc['name']} in llama.cpp vs transformers", "",
             f"{what}: {doc['model_type']}, {doc['num_hidden_layers']} blocks"
             + (f" ({_blocks(pruned)} of {src['original_num_layers']} removed"
                f"{', ' + solver if solver else ''})" if pruned else "") + ". "
             f"Exported with {doc['converter']}; run with llama-cpp-python {doc['llama_cpp_python']} "
             f"({s['threads']} threads, CPU, "
             f"{'an f32 KV cache' if s.get('kv_cache') == 'f32' else 'its default f16 KV cache'}, "
             f"flash attention {s.get('flash_attn', 'off')}). Reference: "
             f"{s['reference']}.", "",
             f"Greedy: {s['new_tokens']} new tokens after each of {s['prompts']} prompts ({s['prompt_len']} tokens of "
             f"held-out documents). KL(HF ‖ llama.cpp): nats per predicted token over {s['windows']} windows × "
             f"{s['seq_len']} tokens ({s['text']}). Both runtimes get the HF tokenizer's ids; llama.cpp's own "
             f"tokenizer gives the same ids for {doc['tokenizer_identical']} of the prompts' documents "
             "(first 400 characters).", "", *_tokenizer_lines(doc.get("tokenizers")),
             C.md_table(["format", "file MB", "block_count", "greedy identical", "KL mean", "KL max", "top-1 agree",
                         "ppl HF", "ppl llama.cpp"],
                        [[f, r["file_mb"], r["block_count"], f"{r['greedy_identical']}/{r['greedy_prompts']}",
                          f"{r['kl_mean']:.2e}", f"{r['kl_max']:.2e}", f"{r['top1_agree']:.4f}", r["ppl_hf"],
                          r["ppl_llama_cpp"]] for f, r in doc["formats"].items()]), ""]
    for f, r in doc["formats"].items():
        if r.get("export_refused"):
            lines.append(f"{f}: converted without the export's check (--unchecked); the export refuses this file: "
                         f"{r['export_refused']}")
        if r["diverged"]:
            lines.append(f"{f}: greedy continuations part at " + ", ".join(
                f"prompt {d['prompt']} token {d['at']} (HF top-2 margin {d['hf_margin']:.3g})" for d in r["diverged"]))
    lines += ["", f"Reproduce: `{doc['command']}` ({doc['seconds']:.0f} s). llama_cpp module: "
              f"`{doc.get('llama_cpp_module', '?')}`, its library: `{doc.get('llama_cpp_library', '?')}`."]
    return "\n".join(lines) + "\n"


def _tokenizer_lines(tokenizers: dict | None) -> list[str]:
    """The tokenizer comparison's table (older results have none)."""
    if not tokenizers:
        return []
    rows = [[name, f"{g['identical']}/{g['texts']}", "; ".join(
        f"{e['at']!r}: HF {e['hf']} vs llama.cpp {e['llama_cpp']}" for e in g["examples"]) or "–"]
        for name, g in tokenizers.items()]
    return ["llama.cpp's own tokenizer (`Llama.tokenize`) against transformers' on the same texts:", "",
            C.md_table(["texts", "same ids", "where they part (first differing ids)"], rows), ""]


def rerender(json_file: str | Path) -> Path:
    """Rewrite ``<name>.md`` from ``<name>.json`` (no model is run)."""
    doc = json.loads(Path(json_file).read_text())
    return write_text_atomic(Path(json_file).with_suffix(".md"), render(doc))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", choices=["smollm2-135m", "gemma3-270m", "tiny"], help="prune this model (no repair) and check it")
    src.add_argument("--folder", help="a saved folder (without adapters) to check as it is")
    ap.add_argument("--name", default=None, help="results file name (default: the model, or the folder's name)")
    ap.add_argument("--layers", default=None, help="blocks to remove, comma-separated or a-b (with --model)")
    ap.add_argument("--formats", default="f32,f16,q8_0")
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--prompt_len", type=int, default=32)
    ap.add_argument("--new_tokens", type=int, default=16)
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--seq_len", type=int, default=128)
    ap.add_argument("--llama_cpp", default=None, help="a llama.cpp checkout whose converter runs")
    ap.add_argument("--unchecked", action="store_true", help="convert without the layer metadata check and record "
                    "its verdict: what llama.cpp does with a file the export refuses")
    ap.add_argument("--kv_f32", action="store_true", help="run llama.cpp with an f32 KV cache (default: its f16 one)")
    ap.add_argument("--flash_attn", action="store_true", help="run llama.cpp with flash attention (default: off, "
                    "llama-cpp-python's default; llama.cpp's own tools turn it on by default)")
    ap.add_argument("--threads", type=int, default=None, help="llama.cpp's threads (default: half the cores)")
    ap.add_argument("--out", default=str(ROOT / "results" / "llama_cpp"))
    a = ap.parse_args(argv)
    layers = None
    if a.layers:
        layers = sorted({i for part in a.layers.split(",") for i in (
            range(int(part.split("-")[0]), int(part.split("-")[1]) + 1) if "-" in part else [int(part)])})
    try:
        doc = run_check(a.folder, a.model, a.name, tuple(a.formats.split(",")), layers, a.prompts, a.prompt_len,
                        a.new_tokens, a.windows, a.seq_len, a.out, llama_cpp=a.llama_cpp, threads=a.threads,
                        unchecked=a.unchecked, kv_f32=a.kv_f32, flash_attn=a.flash_attn,
                        command=shlex.join(["python", "experiments/checks/llama_cpp_check.py",
                                            *(sys.argv[1:] if argv is None else argv)]))
    except (ShiftError, GGUFError) as e:
        sys.stderr.write(f"error: {' '.join(str(e).split())}\n")
        raise SystemExit(2) from None
    print(render(doc))
    print(f"Results in {Path(a.out) / doc['name']}.json / .md")
    return doc


if __name__ == "__main__":
    main()
