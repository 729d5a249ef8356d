"""Onloaded calibration: ``calibrate.py`` on a model larger than memory, measured from outside.

Writes a random-weight Llama model of a named shape as a plain HF folder (sharded safetensors,
config, byte-level tokenizer), block by block so that the writer never holds the whole model, then
runs ``calibrate.py`` on it once per ``--solver`` as a subprocess and measures, from this process:

* wall seconds of the job (and the phase seconds of its ``calibration_report.json``);
* memory of the job's process tree, sampled every 50 ms (:class:`TreeWatcher`): the peak of the
  summed ``RssAnon`` (what onloading must keep small: memory-mapped weight pages are ``RssFile``,
  reclaimable page cache) next to the peak ``VmHWM`` (which counts mapped file pages too);
* a hard memory limit (``--limit_gib``): the job runs in a child cgroup (v1 memory controller) of
  this process's own cgroup, with ``memory.limit_in_bytes`` (and ``memory.memsw.limit_in_bytes``)
  set; whether the kernel OOM-killed it is read from ``memory.oom_control``. The limit counts page
  cache as well, which the kernel reclaims before it kills. No writable cgroup: "no limit", said so;
  ``prlimit --as`` is no substitute (address space counts every mapped file);
* bytes the job read from disk (``read_bytes`` of ``/proc/<pid>/io``, exact over the tree from
  ``wait4``'s ``ru_inblock``), with the model files evicted from the page cache before each job
  (``--page_cache``), as a multiple of the size of the model's safetensors files.

    python benchmarks/onload.py --shape llama3-8b --solver lra lra_replaceme --limit_gib 8
    python benchmarks/onload.py --shape llama3-70b-w8 --solver lra --num_samples 32 --seq_len 2048
    python benchmarks/onload.py --shape tiny --placement memory --num_samples 8 --seq_len 64   # smoke run

``--placement memory`` runs the same job with the model in memory (``--model.placement memory``).
The generated folder and the job outputs are deleted at the end, also on failure (``--keep_model``
keeps them). Writes ``results/bench/onload_<shape>.json`` (``--out``) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from pathlib import Path

import bench_common as C
import torch

from shift_lightning.models import EMBEDDED_MODELS, dequantised_folder

#: Llama shapes (random weights, real sizes); ``num_hidden_layers`` is the default depth.
SHAPES: dict[str, dict] = {
    # Llama-3.1-8B: 32 blocks, d = 4096, FFN 14336, 32 query / 8 KV heads, vocab 128256, untied
    "llama3-8b": C.SHAPES["llama3-8b"],
    # the width of Llama-3.1-70B (d = 8192, FFN 28672, 64 query / 8 KV heads) with 8 blocks
    "llama3-70b-w8": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=8, num_attention_heads=64,
                          num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=8192,
                          rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False),
    # 8 blocks, d = 64: a smoke run in seconds
    "tiny": C.SHAPES["tiny"],
}

GIB = 2 ** 30
MEMORY_CGROUPS = Path("/sys/fs/cgroup/memory")  # cgroup v1 memory hierarchy


# ------------------------------------------------------------------------------------------------
# The model folder
def shard_layout(cfg) -> list[list[tuple[str, tuple[int, ...]]]]:
    """``[[(tensor name, shape), ...] per shard]``: embeddings, final norm and head first, then one
    shard per block, named as HF Llama names them."""
    d, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    outer = [("model.embed_tokens.weight", (v, d)), ("model.norm.weight", (d,))]
    if not cfg.tie_word_embeddings:
        outer.append(("lm_head.weight", (v, d)))
    shards = [outer]
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        shards.append([(p + "self_attn.q_proj.weight", (q, d)), (p + "self_attn.k_proj.weight", (kv, d)),
                       (p + "self_attn.v_proj.weight", (kv, d)), (p + "self_attn.o_proj.weight", (d, q)),
                       (p + "mlp.gate_proj.weight", (f, d)), (p + "mlp.up_proj.weight", (f, d)),
                       (p + "mlp.down_proj.weight", (d, f)), (p + "input_layernorm.weight", (d,)),
                       (p + "post_attention_layernorm.weight", (d,))])
    return shards


def llama_config(shape: dict, num_layers: int | None = None, dtype: torch.dtype = torch.bfloat16):
    """The ``LlamaConfig`` of a shape, with the special ids of :func:`tiny_tokenizer`."""
    from transformers import LlamaConfig

    from shift_lightning.models import tiny_tokenizer

    tok = tiny_tokenizer()
    return LlamaConfig(**{**shape, "num_hidden_layers": num_layers or shape["num_hidden_layers"]},
                       bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                       architectures=["LlamaForCausalLM"], dtype=str(dtype).replace("torch.", ""))


def model_bytes(cfg, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes of the weights (the safetensors payload) of ``cfg``."""
    n = sum(torch.Size(s).numel() for shard in shard_layout(cfg) for _, s in shard)
    return n * torch.empty((), dtype=dtype).element_size()


def _random(name: str, shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """N(0, 0.02²) weights, 1 + N(0, 0.02²) norm scales; one generator per tensor, seeded from its name."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{name}".encode()))
    t = torch.empty(shape, dtype=dtype).normal_(0.0, 0.02, generator=g)
    return t.add_(1.0) if name.endswith("norm.weight") else t


def write_random_model(folder: str | Path, shape: dict, num_layers: int | None = None,
                       dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> Path:
    """Write a random-weight Llama model of ``shape`` (a :data:`SHAPES` entry; ``num_layers`` blocks,
    default the shape's) as an HF folder: ``config.json``, one safetensors shard per block plus one
    for the embeddings, final norm and head, ``model.safetensors.index.json`` and the byte-level
    tokenizer. One shard is in memory at a time. Deterministic in ``seed``."""
    from safetensors.torch import save_file

    from shift_lightning.models import tiny_tokenizer

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = llama_config(shape, num_layers, dtype)
    layout = shard_layout(cfg)
    weight_map, total = {}, 0
    for k, shard in enumerate(layout):
        fname = f"model-{k + 1:05d}-of-{len(layout):05d}.safetensors"
        tensors = {name: _random(name, s, dtype, seed) for name, s in shard}
        save_file(tensors, str(folder / fname), metadata={"format": "pt"})
        total += sum(t.nbytes for t in tensors.values())
        weight_map.update({name: fname for name in tensors})
        del tensors
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    cfg.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def check_hf_load(folder: Path) -> dict:
    """Load ``folder`` with ``transformers.AutoModelForCausalLM`` (whole model in memory: small shapes
    only) and run a forward pass; raises on missing/unexpected keys or non-finite logits."""
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    bad = {k: v for k, v in info.items() if v}
    if bad:
        raise SystemExit(f"{folder} does not load cleanly: {bad}")
    ids = torch.randint(0, 259, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    if not torch.isfinite(logits).all():
        raise SystemExit(f"{folder}: non-finite logits")
    return {"class": type(model).__name__, "dtype": str(model.dtype), "logits_shape": list(logits.shape),
            "loading_info": {k: len(v) for k, v in info.items()}}


def human(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2 ** 20:.2f} MiB"


def safetensors_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


# ------------------------------------------------------------------------------------------------
# Measuring a process tree
def _status_kib(pid: int, fields: tuple[str, ...]) -> dict[str, int]:
    """``{field: kB}`` from ``/proc/<pid>/status`` (empty once the process is gone)."""
    out = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key = line.split(":", 1)[0]
            if key in fields:
                out[key] = int(line.split()[1])
    except OSError:
        return {}
    return out


def _read_bytes(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/io").read_text().splitlines():
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def process_tree(root: int) -> list[int]:
    """``root`` and all its descendants, from the parent ids in ``/proc/*/stat`` (this kernel has no
    ``/proc/<pid>/task/<tid>/children``)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # the name in parentheses may hold spaces
        children.setdefault(ppid, []).append(int(entry))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += children.get(pid, [])
    return tree


class TreeWatcher(threading.Thread):
    """Samples the process tree of ``root`` every ``interval`` seconds until :meth:`stop`: peak of the
    summed ``RssAnon`` and ``RssFile``, peak ``VmHWM`` of any one process, and ``read_bytes`` of
    every process seen (its last value; the sum is a lower bound when a process did I/O in the
    ``interval`` before it ended)."""

    def __init__(self, root: int, interval: float = 0.05):
        super().__init__(daemon=True)
        self.root, self.interval, self._halt = root, interval, threading.Event()
        self.peak_anon = self.peak_file = self.peak_hwm = 0  # bytes
        self.read_bytes: dict[int, int] = {}
        self.samples = self.max_processes = 0
        self.t0, self.timeline = time.perf_counter(), []  # (seconds, RssAnon GiB): the peak of each second

    def run(self) -> None:
        while not self._halt.is_set():
            self.sample()
            self._halt.wait(self.interval)

    def sample(self) -> None:
        anon = file = 0
        tree = process_tree(self.root)
        for pid in tree:
            st = _status_kib(pid, ("RssAnon", "RssFile", "VmHWM"))
            anon += st.get("RssAnon", 0) * 1024
            file += st.get("RssFile", 0) * 1024
            self.peak_hwm = max(self.peak_hwm, st.get("VmHWM", 0) * 1024)
            rb = _read_bytes(pid)
            if rb is not None:
                self.read_bytes[pid] = rb
        self.peak_anon, self.peak_file = max(self.peak_anon, anon), max(self.peak_file, file)
        t = round(time.perf_counter() - self.t0)
        if self.timeline and self.timeline[-1][0] == t:
            self.timeline[-1][1] = max(self.timeline[-1][1], round(anon / GIB, 3))
        else:
            self.timeline.append([t, round(anon / GIB, 3)])
        self.samples, self.max_processes = self.samples + 1, max(self.max_processes, len(tree))

    def stop(self) -> dict:
        self._halt.set()
        self.join()
        return {"peak_tree_rss_anon_bytes": self.peak_anon, "peak_tree_rss_file_bytes": self.peak_file,
                "peak_vmhwm_bytes": self.peak_hwm, "sampled_read_bytes": sum(self.read_bytes.values()),
                "samples": self.samples, "interval_s": self.interval, "max_processes": self.max_processes,
                "rss_anon_gib_per_second": self.timeline}


# ------------------------------------------------------------------------------------------------
# Memory limit and page cache
class MemoryLimit:
    """A child cgroup (v1 memory controller) of this process's own memory cgroup, limited to
    ``limit_bytes``; ``wrap(cmd)`` starts ``cmd`` inside it. Without a writable hierarchy (or with
    ``limit_bytes`` 0) ``wrap`` is the identity and ``mechanism`` says "no limit" and why."""

    def __init__(self, limit_bytes: int, name: str):
        self.path: Path | None = None
        if not limit_bytes:
            self.mechanism = "no limit (--limit_gib 0)"
            return
        own = next((line.split(":", 2)[2] for line in Path("/proc/self/cgroup").read_text().splitlines()
                    if line.split(":", 2)[1] == "memory"), None)
        if own is None or not (MEMORY_CGROUPS / "memory.limit_in_bytes").exists():
            self.mechanism = "no limit (no cgroup v1 memory controller)"
            return
        path = MEMORY_CGROUPS / own.lstrip("/") / name
        try:
            path.mkdir()
            (path / "memory.limit_in_bytes").write_text(str(limit_bytes))
            files = ["memory.limit_in_bytes"]
            if (path / "memory.memsw.limit_in_bytes").exists():  # memory + swap: no escape into swap
                (path / "memory.memsw.limit_in_bytes").write_text(str(limit_bytes))
                files.append("memory.memsw.limit_in_bytes")
        except OSError as e:
            if path.exists():
                path.rmdir()
            self.mechanism = f"no limit (cgroup {path} not writable: {e})"
            return
        self.path = path
        self.mechanism = f"cgroup v1 {' + '.join(files)} = {limit_bytes} ({path})"

    def wrap(self, cmd: list[str]) -> list[str]:
        """``cmd`` started in the cgroup: the shell moves itself in, then ``exec``s (same pid)."""
        if self.path is None:
            return cmd
        return ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(self.path), *cmd]

    def counters(self) -> dict:
        """The cgroup's peak usage (page cache included) and OOM counters; ``{}`` without one."""
        if self.path is None:
            return {}
        oom = dict(line.split() for line in (self.path / "memory.oom_control").read_text().splitlines())
        return {"cgroup_max_usage_bytes": int((self.path / "memory.max_usage_in_bytes").read_text()),
                "cgroup_failcnt": int((self.path / "memory.failcnt").read_text()),
                "cgroup_oom_kill": int(oom.get("oom_kill", 0))}

    def remove(self) -> None:
        """Remove the cgroup (retried while the kernel still lists exiting tasks in it)."""
        for _ in range(50):
            if self.path is None or not self.path.exists():
                return
            try:
                self.path.rmdir()
                return
            except OSError as e:
                if e.errno != errno.EBUSY:
                    raise
                time.sleep(0.1)
        print(f"warning: could not remove cgroup {self.path}", file=sys.stderr)


def evict_page_cache(how: str, model_dir: Path) -> str:
    """Make the job read the weights from disk; what was done, or why not. ``model``: drop the pages
    of the safetensors files only (``posix_fadvise(DONTNEED)``, no privileges needed; Python and
    torch stay cached, so the job's reads are the weights'); ``all``: ``sync; echo 3 >
    /proc/sys/vm/drop_caches`` (root; the job then also re-reads its libraries); ``keep``: nothing."""
    if how == "keep":
        return "kept"
    os.sync()
    if how == "model":
        for f in model_dir.glob("*.safetensors"):
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        return "model files evicted (posix_fadvise DONTNEED)"
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3")
        return "all dropped (drop_caches)"
    except OSError as e:
        return f"not dropped ({e})"


# ------------------------------------------------------------------------------------------------
# One job
def job_command(a, model_dir: Path, solver: str, out_dir: Path) -> list[str]:
    placement = [] if a.no_placement_flag else ["--model.placement", a.placement]
    return [sys.executable, str(C.ROOT / "calibrate.py"), "--model.name_or_path", str(model_dir), *placement,
            "--model.dtype", a.dtype, "--data.source", "wiki_summaries", "--data.num_samples", str(a.num_samples),
            "--data.seq_len", str(a.seq_len), "--data.batch_size", str(a.batch_size), "--heldout.num_samples",
            str(a.heldout_samples), "--heldout.seq_len", str(a.seq_len), "--heldout.batch_size", str(a.batch_size),
            "--prune.criterion", a.criterion, "--prune.ratio", str(a.ratio), "--calibration.solver", solver,
            "--evaluate_baselines", "false", "--trainer.accelerator", "cpu", "--trainer.enable_progress_bar", "false",
            "--save_model", "true" if a.save_model else "false", "--output_dir", str(out_dir)]


def exit_status(rc: int, oom_kills: int, stderr_tail: str) -> str:
    if rc == 0:
        return "ok"
    if rc == -9 and oom_kills:
        return "OOM-killed (cgroup limit)"
    if rc == -9:
        return "killed (SIGKILL)"
    if rc == 2 and "model.placement" in stderr_tail:  # argparse's exit status: unknown flag or value
        return "calibrate.py rejects --model.placement"
    return f"exit {rc}"


def run_job(a, model_dir: Path, solver: str, run_dir: Path, model_size: int) -> dict:
    """Run one calibration job under the limit and the watcher; the measurements as a dict."""
    out_dir, log = run_dir / f"out_{solver}", run_dir / f"log_{solver}.txt"
    cmd = job_command(a, model_dir, solver, out_dir)
    cache = evict_page_cache(a.page_cache, model_dir)
    limit = MemoryLimit(int(a.limit_gib * GIB), f"shift_onload_{os.getpid()}_{solver}")
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads), "MKL_NUM_THREADS": str(a.threads)}
    try:
        t0 = time.perf_counter()
        with open(log, "w") as fh:
            p = subprocess.Popen(limit.wrap(cmd), stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=C.ROOT)
        watcher = TreeWatcher(p.pid)
        watcher.start()
        try:
            _, status, usage = os.wait4(p.pid, 0)  # rusage of the job and every descendant it reaped
        except BaseException:  # interrupted: never leave the job running
            p.kill()
            p.wait()
            raise
        finally:
            mem = watcher.stop()
        seconds = time.perf_counter() - t0
        p.returncode = rc = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait again
        counters = limit.counters()
    finally:
        limit.remove()
    tail = log.read_text()[-3000:]
    report = out_dir / "calibration_report.json"
    rep = json.loads(report.read_text()) if rc == 0 and report.exists() else None
    if not a.keep_model:  # the written model (tens of GB at fp32) is not kept between jobs
        shutil.rmtree(out_dir, ignore_errors=True)
    read = usage.ru_inblock * 512  # ru_inblock: read_bytes / 512 of the job tree
    res = {"solver": solver, "placement": a.placement if not a.no_placement_flag else "(flag omitted)",
           "command": " ".join(cmd), "returncode": rc,
           "status": exit_status(rc, counters.get("cgroup_oom_kill", 0), tail),
           "wall_seconds": seconds, "report_seconds": rep["seconds"] if rep else None,
           "pruned_layers": rep["pruned_layers"] if rep else None,
           "limit": limit.mechanism, "limit_bytes": int(a.limit_gib * GIB), "page_cache": cache,
           **mem, "ru_maxrss_bytes": usage.ru_maxrss * 1024, "read_bytes": read,
           "read_over_model": read / model_size, **counters}
    if rc != 0:
        res["log_tail"] = tail
    return res


# ------------------------------------------------------------------------------------------------
# The memory model (docs/larger-than-memory.md), checked against the measured peaks
def base_rss_anon() -> int:
    """RssAnon of a process that has imported what the job imports (torch, Lightning, transformers, the recipe)."""
    code = ("import shift_lightning.recipes.calibrate, shift_lightning.calibration.module, transformers, lightning;"
            "print([l for l in open('/proc/self/status') if l.startswith('RssAnon')][0].split()[1])")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=C.ROOT, check=True)
    return int(r.stdout.strip().splitlines()[-1]) * 1024


def predicted_peak(cfg, solver: str, removed: list[int], windows: int, seq_len: int, batch: int,
                   dtype_bytes: int, base: int, heldout: int = 0, chunk: int = 128) -> dict:
    """Peak memory of one rank from the formula of docs/larger-than-memory.md: the process, plus the largest of
    the phases (caching: the states, a batch's embedding rows; walk: one block, the states, one batch's activations,
    the sums of the site being walked and the solutions before it; solve (between blocks): a site's sums, the
    solutions before it and its solve's Cholesky factor, the solve's copy of it, the right-hand side and the solution;
    errors: the held-out errors' walk, one block and the solutions; report: the held-out report's walk, one block,
    three streams, the maps and a fold into the block's down_proj; head: the report's LM head, the maps and a chunk
    of logits twice; save: one block or one top-level tensor, and the maps). ``heldout``: held-out windows (0: no
    errors or report); ``chunk``: the report's positions of logits at a time."""
    d, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    block = (2 * d * q + 2 * d * kv + 3 * d * f + 2 * d) * dtype_bytes
    states = windows * seq_len * d * dtype_bytes
    held = heldout * seq_len * d * dtype_bytes
    per_batch = seq_len * (3 * f + 4 * d + q + 2 * kv) * dtype_bytes  # one window inside a block (MLP, attention)
    acts, acts_h = batch * per_batch, min(batch, heldout) * per_batch
    ridge = lambda din, dout: 8 * ((din + 1) ** 2 + (din + 1) * dout + 1)  # noqa: E731
    spans = []
    for i in sorted(removed):
        if spans and spans[-1][1] == i:
            spans[-1][1] = i + 1
        else:
            spans.append([i, i + 1])
    if solver == "lra":  # one site a removed block; the solution W (d x d) and b in float64
        sites, solution, extra_states, d_in = [ridge(d, d)] * len(removed), 8 * (d * d + d), 0, [d] * len(removed)
        fold, branch = 0, 0
    elif solver == "lra_replaceme":  # one site a span: [x, m] (2d inputs) and x; the solution W, T
        sites = [ridge(2 * d, d) + ridge(d, d) if s >= 1 else ridge(d, d) for s, _ in spans]
        solution, extra_states, d_in = 8 * (2 * d * d + d), 2 * states, [2 * d if s >= 1 else d for s, _ in spans]
        fold = 2 * 8 * d * f + dtype_bytes * d * f  # ReplaceMe's T folded into down_proj: W in float64, Tᵀ W, the cast
        branch = 8 * d * d  # the correction's T (float64) beside each span's adapter
    else:
        raise ValueError(f"no memory model for solver {solver!r}")
    # each site's sums are allocated at its first block and freed once solved after its last: the walk holds the
    # sums of the site being walked and the solutions of the sites before it; the solve, beside them, the Cholesky
    # factor L of the damped Gram matrix and cholesky_solve's copy of it (d_in² each) and the right-hand side and the
    # solution (d_in × d each; the Gram matrix is freed before the solve)
    walked = max(st + n * solution for n, st in enumerate(sites))
    solved = max(st + n * solution + 2 * 8 * di * di + 2 * 8 * di * d for n, (st, di) in enumerate(zip(sites, d_in)))
    maps = len(spans) * (d * d * dtype_bytes + branch)  # the correction: each span's adapter (and T)
    phases = {"caching": batch * seq_len * d * dtype_bytes + states,
              "walk": block + states + extra_states + acts + walked,
              "solve": states + extra_states + solved,
              "save": max(block + fold, v * d * dtype_bytes) + maps}
    if heldout:
        phases.update({"errors": block + held + acts_h + len(sites) * solution,
                       "report": block + 3 * held + acts_h + maps + fold,
                       "head": v * d * dtype_bytes + 6 * held + maps + 2 * chunk * v * 4})
    worst = max(phases, key=phases.get)
    return {"base_bytes": base, "phases_bytes": phases, "peak_phase": worst, "predicted_peak_bytes": base + phases[worst]}


# ------------------------------------------------------------------------------------------------
# In this process, on one device: onloaded (device memory capped) beside in memory (the GPU script's step)
def in_process(a, model_dir: Path) -> dict:
    """``run_calibration`` twice in this process on ``--device``: onloaded first, with the device memory capped at
    ``--device_cap_gib`` (``torch.cuda.set_per_process_memory_fraction``; CUDA only), then in memory; seconds, peak
    device memory and whether the two runs' maps are equal. ``--placement`` is ignored here."""
    from shift_lightning.calibration import CalibrationConfig
    from shift_lightning.criteria import PruneConfig
    from shift_lightning.data import TextDataConfig
    from shift_lightning.models import ModelConfig
    from shift_lightning.recipes.calibrate import run_calibration
    from shift_lightning.maps.surgery import adapter_set

    dev = C.pick_device(a.device)
    cuda = dev.type == "cuda"
    runs, maps = {}, {}
    order = [("onload", "memory") if r % 2 == 0 else ("memory", "onload") for r in range(a.repeats)]
    for placement in [p for pair in order for p in pair]:  # alternating: a warm page cache for both
        cap = a.device_cap_gib if cuda and placement == "onload" else None
        if cuda:
            total = torch.cuda.get_device_properties(dev).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, cap * GIB / total) if cap else 1.0, dev)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(dev)
        t0 = time.perf_counter()
        res = run_calibration(
            model=ModelConfig(name_or_path=str(model_dir), placement=placement, dtype=a.dtype),
            data=TextDataConfig(source="wiki_summaries", num_samples=a.num_samples, seq_len=a.seq_len,
                                batch_size=a.batch_size),
            heldout=TextDataConfig(source="wiki_summaries", split="heldout", num_samples=a.heldout_samples,
                                   seq_len=a.seq_len, batch_size=a.batch_size),
            prune=PruneConfig(criterion=a.criterion, ratio=a.ratio), calibration=CalibrationConfig(solver=a.solver[0]),
            trainer=dict(accelerator="gpu" if cuda else "cpu", devices=[dev.index or 0] if cuda else 1,
                         enable_progress_bar=False))
        if cuda:
            torch.cuda.synchronize(dev)
        run = runs.setdefault(placement, {"seconds": [], "calibration_seconds": [], "device_cap_gib": cap,
                                          "peak_device_bytes": None})
        run["seconds"].append(time.perf_counter() - t0)
        run["calibration_seconds"].append(res.report.seconds.get("calibration"))
        if cuda:
            run["peak_device_bytes"] = max(run["peak_device_bytes"] or 0, torch.cuda.max_memory_allocated(dev))
        maps[placement] = {k: v.detach().cpu() for k, v in adapter_set(res.model).state_dict().items()}
        del res
    same = maps["onload"].keys() == maps["memory"].keys() and all(
        torch.equal(maps["onload"][k], maps["memory"][k]) for k in maps["memory"])
    best = {p: min(r["calibration_seconds"]) for p, r in runs.items()}
    return {"device": str(dev), "solver": a.solver[0], "runs": runs, "same_maps": same, "repeats": a.repeats,
            "best_calibration_seconds": best,
            "onload_over_memory_calibration": best["onload"] / best["memory"]}


# ------------------------------------------------------------------------------------------------
def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    ap.add_argument("--num_layers", type=int, default=None, help="blocks (default: the shape's)")
    ap.add_argument("--solver", nargs="+", default=["lra"], help="calibration solvers, one job each")
    ap.add_argument("--placement", default="onload", help="--model.placement of calibrate.py (onload, memory)")
    ap.add_argument("--dtype", default="float32", help="--model.dtype of calibrate.py (files are bfloat16)")
    ap.add_argument("--num_samples", type=int, default=8, help="calibration windows")
    ap.add_argument("--seq_len", type=int, default=512)
    ap.add_argument("--batch_size", type=int, default=4)
    ap.add_argument("--criterion", default="reverse_star")
    ap.add_argument("--ratio", type=float, default=0.25)
    ap.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of the job")
    ap.add_argument("--limit_gib", type=float, default=8.0, help="memory limit of the job (0: none)")
    ap.add_argument("--page_cache", default="model", choices=["model", "all", "keep"],
                    help="before each job, evict the model files from the page cache (model), drop the whole "
                         "cache (all: root only; the job re-reads its libraries too), or not (keep)")
    ap.add_argument("--save_model", action="store_true", help="let calibrate.py write the pruned model too")
    ap.add_argument("--verify", action="store_true",
                    help="load the written folder with AutoModelForCausalLM and run a forward (small shapes)")
    ap.add_argument("--heldout_samples", type=int, default=4, help="held-out windows (the held-out errors' pass)")
    ap.add_argument("--in_process", action="store_true",
                    help="run onloaded (device memory capped) and in memory in this process on --device (GPU script)")
    ap.add_argument("--device", default="auto", help="--in_process: cuda or cpu")
    ap.add_argument("--device_cap_gib", type=float, default=8.0, help="--in_process on CUDA: the onloaded run's cap")
    ap.add_argument("--repeats", type=int, default=1, help="--in_process: runs of each placement, alternating (best)")
    ap.add_argument("--model_dir", default=None, help="an existing model folder to use (not written, never deleted), "
                    "or an embedded model (smollm2-135m: its de-quantised folder)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", default=None, help="where the model folder is written (default: the temp dir)")
    ap.add_argument("--keep_model", action="store_true", help="keep the model folder and job outputs")
    ap.add_argument("--out", default=None)
    ap.add_argument("--no_placement_flag", action="store_true", help=argparse.SUPPRESS)  # before the flag exists
    a = ap.parse_args(argv)
    a.argv = sys.argv[1:] if argv is None else list(argv)
    return a


def main(argv=None):
    a = parse(argv)
    cfg = llama_config(SHAPES[a.shape], a.num_layers)
    need = (0 if a.model_dir else model_bytes(cfg)) + GIB  # the weights, plus room for the job outputs
    base = Path(a.workdir or tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(base).free
    if free < need:
        raise SystemExit(f"{base} has {free / GIB:.1f} GiB free, the {a.shape} model needs {need / GIB:.1f} GiB: "
                         "choose another --workdir")
    run_dir = Path(tempfile.mkdtemp(prefix=f"onload_{a.shape}_", dir=base))
    out = Path(a.out or C.ROOT / "results" / "bench" / f"onload_{a.shape}.json")
    doc = {"benchmark": "onload", "shape": a.shape, "config": cfg.to_dict(), "command":
           "python benchmarks/onload.py " + " ".join(a.argv),
           "machine": C.machine(C.pick_device(a.device) if a.in_process else torch.device("cpu")),
           "windows": a.num_samples, "seq_len": a.seq_len, "batch_size": a.batch_size, "dtype": a.dtype,
           "threads": a.threads, "runs": []}
    try:
        t = time.perf_counter()
        if a.model_dir in EMBEDDED_MODELS:  # a real model: its de-quantised safetensors folder
            model_dir = dequantised_folder(a.model_dir)
        else:
            model_dir = Path(a.model_dir) if a.model_dir else write_random_model(run_dir / "model", SHAPES[a.shape],
                                                                                 a.num_layers, seed=a.seed)
        doc["write_seconds"] = None if a.model_dir else time.perf_counter() - t
        doc["model_bytes"] = size = safetensors_bytes(model_dir)
        print(f"{model_dir}: {human(size)} of safetensors", flush=True)
        if a.verify:
            doc["hf_load_check"] = check_hf_load(model_dir)
            print(f"AutoModelForCausalLM loads it: {doc['hf_load_check']}", flush=True)
        if a.in_process:
            doc["in_process"] = in_process(a, model_dir)
            C.write_json(out, doc)
            print(json.dumps(doc["in_process"], indent=2))
            return
        doc["base_rss_anon_bytes"] = base = base_rss_anon()
        for solver in a.solver:
            res = run_job(a, model_dir, solver, run_dir, size)
            if res["pruned_layers"] is not None and solver in ("lra", "lra_replaceme"):
                res["model"] = predicted_peak(cfg, solver, res["pruned_layers"], a.num_samples, a.seq_len, a.batch_size,
                                              torch.empty((), dtype=getattr(torch, a.dtype)).element_size(), base,
                                              a.heldout_samples)
                res["measured_over_predicted"] = res["peak_tree_rss_anon_bytes"] / res["model"]["predicted_peak_bytes"]
            doc["runs"].append(res)
            print(f"{solver}: {res['status']} in {res['wall_seconds']:.1f} s", flush=True)
            if "log_tail" in res:
                print(res["log_tail"][-1500:], file=sys.stderr)
            C.write_json(out, doc)  # after every job: a later failure keeps what was measured
    finally:
        if a.keep_model:
            print(f"kept {run_dir}")
        else:
            shutil.rmtree(run_dir, ignore_errors=True)
    rows = [[a.shape, human(size), r["solver"], r["placement"], f"{a.num_samples}×{a.seq_len}",
             r["wall_seconds"], r["peak_tree_rss_anon_bytes"] / GIB,
             r["model"]["predicted_peak_bytes"] / GIB if "model" in r else None, r["peak_vmhwm_bytes"] / GIB,
             f"{a.limit_gib:g} GiB" if r["limit"].startswith("cgroup") else "none", r["read_over_model"], r["status"]]
            for r in doc["runs"]]
    doc["table"] = C.md_table(["shape", "model on disk", "solver", "placement", "windows×len", "seconds",
                               "peak tree RssAnon GiB", "predicted GiB", "peak VmHWM GiB", "limit", "read ÷ model", "exit"], rows)
    C.write_json(out, doc)
    notes = sorted({f"limit: {r['limit']}; page cache: {r['page_cache']}" for r in doc["runs"]})
    print("\n" + doc["table"] + "\n\n" + "\n".join(notes) + f"\n\nwrote {out}")


if __name__ == "__main__":
    main()
