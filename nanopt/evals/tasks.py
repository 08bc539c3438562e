"""Downstream tasks, lm-eval's and CORE's, scored after training (score_checkpoint) and during it (TaskScorer) into
the run directory; and `lm_class()`, the lm-evaluation-harness model `nanopt`. The harness owns tasks, prompts,
few-shot and metrics; nanopt answers its requests with the continuation scorer and the decode loop. What lm-eval
raises on a task's input is bad input at one boundary (_task_input); nanopt checks only what lm-eval would score
silently (_check_rows). lm-eval (the `eval` extra, a second to import) is imported on first use."""
from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Optional

import torch

from nanopt import hub
from nanopt.config import Config
from nanopt.data.tokenizer import Tokenizer, get_tokenizer
from nanopt.distributed import parallel, runtime
from nanopt.distributed.runtime import Runtime
from nanopt.errors import ConfigError
from nanopt.evals import core_benchmark as core
from nanopt.evals.generate import generate
from nanopt.evals.scoring import continuation_scores
from nanopt.io import append_jsonl, is_number
from nanopt.loading import Loaded, load
from nanopt.recipe.model import Llama
from nanopt.rundirs import EVALS_FILE, TB_DIR, evaluation_key, recorded
from nanopt.training.checkpoint import weights_crc32

log = logging.getLogger("nanopt")
_MANAGERS: dict[Optional[str], Any] = {}


def _lm_eval() -> Any:
    try:
        import lm_eval  # optional dependency: the `eval` extra
        import lm_eval.api.model
        import lm_eval.api.registry
        import lm_eval.utils
    except ImportError:
        raise ConfigError("downstream tasks need lm-evaluation-harness: pip install -e '.[eval]' "
                          "(it brings lm-eval; nanopt train needs none of it).") from None
    logging.getLogger("lm_eval").setLevel(logging.WARNING)  # its per-task INFO lines would bury nanopt's
    logging.getLogger("datasets").setLevel(logging.CRITICAL)  # what it logs on a task's data it raises: named once
    return lm_eval


@functools.cache
def lm_class() -> type:
    """NanoptLM, registered with the harness as `nanopt` on first call (model="nanopt", model_args="path=runs/x")."""
    lm_eval = _lm_eval()

    @lm_eval.api.registry.register_model("nanopt")
    class NanoptLM(lm_eval.api.model.TemplateLM):
        """path: a run, checkpoint or Hugging Face directory; or model + tokenizer (+ rt), as training passes them.
        add_bos_token: BOS first, as nanopt's shards start each document (off where the tokenizer has none)."""

        def __init__(self, path: Optional[str] = None, model: Optional[Llama] = None,
                     tokenizer: Optional[Tokenizer | str] = None, device: str = "auto", precision: str = "run",
                     batch_size: int | str = 32, add_bos_token: bool | str = True, max_gen_toks: int | str = 256,
                     rt: Optional[Runtime] = None, max_batch_size: Any = None) -> None:
            # max_batch_size: the harness passes it for its batch-size search, which nanopt does not need.
            # Any other model_args key is a TypeError naming it (a typo must not be ignored).
            super().__init__()
            self.model, self.tok, self.rt, _ = task_model(path, model, tokenizer, str(device or "auto").split(":")[0],
                                                          precision, rt)  # cuda:0 -> cuda
            self.batch_size = int(batch_size) if str(batch_size).isdigit() else 32  # "auto" -> 32
            self.add_bos = str(add_bos_token).lower() in ("true", "1") and self.tok.bos_id is not None
            self.max_gen_toks = int(max_gen_toks)

        eot_token_id = property(lambda self: self.tok.eos_id if self.tok.eos_id is not None else self.tok.bos_id)
        prefix_token_id = property(lambda self: self.tok.bos_id if self.tok.bos_id is not None else self.tok.eos_id)
        device = property(lambda self: self.rt.device)

        def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None, **kw: Any) -> list[int]:
            ids = self.tok.encode(string)
            return [self.tok.bos_id] + ids if self.add_bos and add_special_tokens is not False else ids

        def tok_decode(self, ids: list[int], **kw: Any) -> str:
            return self.tok.decode(ids)

        def _loglikelihood_tokens(self, requests: list, disable_tqdm: bool = False, **kw: Any) -> list:
            scores = continuation_scores(self.model, [(c, x) for _, c, x in requests], self.rt, self.batch_size)
            for (key, _, _), score in zip(requests, scores):
                self.cache_hook.add_partial("loglikelihood", key, score)
            return scores

        def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
            return _rolling(self, lm_eval.utils, [r.args[0] for r in requests])

        def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
            return [_generate(self, *r.args) for r in requests]

    return NanoptLM


def task_model(path: Optional[str], model: Optional[Llama] = None, tokenizer: Optional[Tokenizer | str] = None,
               device: str = "auto", precision: str = "run", rt: Optional[Runtime] = None,
               weights: str = "run") -> tuple[Llama, Tokenizer, Runtime, Optional[Loaded]]:
    """(model in eval mode on the runtime's device, tokenizer, runtime, its Loaded): loaded from `path`, or given."""
    loaded: Optional[Loaded] = None
    if model is None:
        if not path:
            raise ConfigError("the nanopt harness model needs path=<run directory, checkpoint or Hugging Face "
                              "directory>, e.g. --model_args path=runs/speedrun.")
        model = (loaded := load(path, weights=weights)).model
    name = tokenizer if tokenizer is not None else (loaded.cfg.data.tokenizer if loaded else "byte")
    if not name:
        raise ConfigError(f"{path} has no tokenizer files and no nanopt config naming one; give tokenizer=NAME "
                          f"(a Hugging Face tokenizer directory or `byte`) in --model_args.")
    tok = get_tokenizer(name) if isinstance(name, str) else name
    rt = rt or runtime.init_to_evaluate(device, precision, loaded.cfg.train.precision if loaded else "fp32",
                                        loaded.cfg.runtime.threads if loaded else 0)
    return model.to(rt.device).eval(), tok, rt, loaded


def _rolling(lm: Any, utils: Any, texts: list[str]) -> list[float]:
    """Whole-text log-likelihoods: the harness's disjoint windows, each scored as one continuation, all batched."""
    max_len = lm.model.rope_cos.shape[0]
    per_text = [[utils.make_disjoint_window(w) for w in utils.get_rolling_token_windows(
        token_list=lm.tok.encode(text), prefix_token=lm.prefix_token_id, max_seq_len=max_len, context_len=1)]
        for text in texts]
    scores = iter(continuation_scores(lm.model, [w for ws in per_text for w in ws], lm.rt, lm.batch_size))
    return [sum(next(scores)[0] for _ in ws) for ws in per_text]


def _generate(lm: Any, context: str, gen_kwargs: dict[str, Any]) -> str:
    """Greedy text after `context` until one of the `until` strings (cut before it) or max_gen_toks."""
    until = gen_kwargs.get("until") or []
    until = [s for s in ([until] if isinstance(until, str) else until) if s]
    eos = lm.tok.eos_id  # ends generation as a token (its text may decode to nothing)
    stop = (lambda ids: ids[-1] == eos or any(s in lm.tok.decode(ids) for s in until))
    max_len = lm.model.rope_cos.shape[0]
    max_new = max(1, min(int(gen_kwargs.get("max_gen_toks", lm.max_gen_toks)), max_len - 1))
    prompt = lm.tok_encode(context)[-(max_len - max_new):]  # cropped on the left to leave room for the answer
    with lm.rt.autocast():
        ids = generate(lm.model, torch.tensor([prompt], device=lm.rt.device), max_new, 0, stop=stop)[0, len(prompt):]
    text = lm.tok.decode([i for i in ids.tolist() if i != eos])
    return min((text.split(s)[0] for s in until), key=len, default=text)  # cut before the first stop string


def _task_manager(tasks: list[str], include_path: Optional[str]) -> Any:
    """lm-eval's TaskManager with the user's task YAMLs; ConfigError naming any task it does not know."""
    _lm_eval()  # the one paragraph when lm-eval is missing
    hub.offline_unless_reachable()  # before lm-eval's task module loads datasets, which reads the offline switch
    from lm_eval.tasks import TaskManager

    if include_path and not Path(include_path).is_dir():
        raise ConfigError(f"--include-path {include_path} is not a directory; give the directory that holds your "
                          f"task YAMLs (e.g. the one `nanopt eval --make-tasks DIR` wrote).")
    manager = _MANAGERS.get(include_path)
    if manager is None and include_path:  # the user's YAMLs alone index in milliseconds
        own = TaskManager(include_path=include_path, include_defaults=False)
        manager = own if _self_contained(own.task_index, tasks) else None
    if manager is None:  # indexing lm-eval's ~15,000 task YAMLs takes seconds: once per process
        manager = _MANAGERS[include_path] = TaskManager(include_path=include_path)
    if unknown := [t for t in tasks if not manager.match_tasks([t])]:
        raise ConfigError(f"unknown lm-eval task(s): {', '.join(unknown)}. Give task or group names the harness "
                          f"knows (`lm-eval ls tasks` lists them) or YAMLs in --include-path; a YAML that does "
                          f"not parse is not listed (check it with `lm-eval validate --tasks NAME "
                          f"--include_path DIR`).")
    return manager


def _self_contained(index: dict[str, Any], names: list[Any], above: frozenset[str] = frozenset()) -> bool:
    """Whether every task and group member named is in `index` (the user's YAMLs); anything unexpected (an inline
    task config, a group inside itself) says no."""
    for name in names:
        entry = index.get(name) if isinstance(name, str) and name not in above else None
        kind = getattr(getattr(entry, "kind", None), "name", None)
        members = (entry.cfg or {}).get("task") if kind == "GROUP" else None
        if kind != "TASK" and not (isinstance(members, list) and _self_contained(index, members, above | {name})):
            return False
    return True


def check_tasks(spec: TaskSpec) -> None:
    """ConfigError now for what scoring would trip over (lm-eval missing, a task unknown or unusable, a bundle that
    does not read): what training finds before its first step."""
    if spec.tasks:
        load_tasks(_task_manager(spec.tasks, spec.include_path), spec.tasks)
    if spec.core_dir:
        core.read_bundle(spec.core_dir, spec.limit or 0)


def evaluate_tasks(lm: Any, tasks: list[str], include_path: Optional[str] = None, limit: Optional[float] = None,
                   num_fewshot: Optional[int] = None) -> Optional[dict[str, Any]]:
    """lm-eval's simple_evaluate on an lm_class() object: its results on the main rank, None elsewhere. What the
    harness raises on task data while it scores is bad input; a model or device failure (RuntimeError) passes."""
    lm_eval = _lm_eval()
    import datasets.exceptions  # both come with lm-eval
    import jinja2

    manager = _task_manager(tasks, include_path)
    built = load_tasks(manager, tasks)  # handed to the harness as objects: each task's data is read once
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    with _task_input(manager, tasks, (ValueError, LookupError, FileNotFoundError, StopIteration,
                                      datasets.exceptions.DatasetsError, jinja2.TemplateError)):
        return lm_eval.simple_evaluate(model=lm, tasks=built, task_manager=manager, limit=limit,
                                       num_fewshot=num_fewshot, log_samples=False, bootstrap_iters=1000)


# ---------------------------------------------------------------- the boundary for lm-eval's task input
def load_tasks(manager: Any, tasks: list[str]) -> list[Any]:
    """The harness's Task and Group objects for `tasks`, built by lm-eval, their rows checked (_check_rows)."""
    built: list[Any] = []
    for name in tasks:
        with _task_input(manager, [name]):  # building reads only the task's own files: any failure is its input's
            loaded = manager.load([name])
            for task in loaded["tasks"].values():
                _check_rows(task)
        top = loaded["groups"].get(name, loaded["tasks"].get(name))
        built += [top] if top is not None else list(loaded["tasks"].values())  # a tag: its tasks
    return built


@contextlib.contextmanager
def _task_input(manager: Any, names: list[str], errors: tuple[type[BaseException], ...] = (Exception,)) -> Any:
    """The boundary: what lm-eval (or datasets, jinja2) raises on the tasks' input is one ConfigError naming them."""
    try:
        yield
    except ConfigError:
        raise
    except errors as e:
        raise _task_error(manager, names, e) from None


def _task_error(manager: Any, names: list[str], e: BaseException) -> ConfigError:
    """The one paragraph for refused task input: the tasks, their YAMLs and data files, the cause (with the reader's
    error datasets wraps: "JSON parse error ... in row 1"); an unreachable, uncached hub dataset: the offline fix."""
    configs = [c for name in names for c in _configs(manager, name, set())]
    if hub.is_unreachable_error(e):
        paths = list(dict.fromkeys(c["dataset_path"] for c in configs if isinstance(c.get("dataset_path"), str)))
        data = f" (its data: {', '.join(paths[:3])}{' ...' if len(paths) > 3 else ''})" if paths else ""
        return ConfigError(hub.not_cached(
            f"lm-eval task {', '.join(names)}{data}", e, "Or score local tasks: `nanopt eval --make-tasks tasks/` "
            "writes demo tasks, nanopt_mc and nanopt_rolling from `--include-path tasks/` (in training "
            "`eval.tasks_path`), and a CORE bundle, tasks/core for `--core` (`eval.core`); docs/evaluation.md, "
            "Downstream tasks.", f"score it once (`nanopt eval RUN --tasks {', '.join(names)} --limit 1`)"))
    yamls = [str(p) for n in names if (p := getattr(manager.task_index.get(n), "yaml_path", None))]
    files = ", ".join(dict.fromkeys(str(f) for c in configs for f in _local_files(c.get("dataset_kwargs"))))
    files = files or "its data"
    inner = e.__cause__ or e.__context__
    why = f"{type(e).__name__}: {e}"
    why += f" ({type(inner).__name__}: {inner})" if inner is not None and str(inner) not in why else ""
    why = f": {files} has no rows" if isinstance(e, StopIteration) else f" (data {files}): {why}"
    return ConfigError(f"lm-eval could not build or score task {', '.join(names)}"
                       f"{' from ' + ', '.join(yamls) if yamls else ''}{why}. Check the task YAML and its data_files: "
                       f"local paths must exist and hold one JSON object a line with the fields the YAML's "
                       f"doc_to_text, doc_to_target and doc_to_choice use (hub datasets need the network).")


def _configs(manager: Any, name: Any, seen: set[str]) -> list[dict[str, Any]]:
    """The YAML config of a task and those of a group's tasks (inline ones too), as lm-eval's index holds them."""
    if isinstance(name, dict):
        return [name]
    if not isinstance(name, str) or name in seen:
        return []
    seen.add(name)
    cfg = getattr(manager.task_index.get(name), "cfg", None) or {}
    members = cfg.get("task") if "group" in cfg else None
    return [cfg] + [c for m in (members if isinstance(members, list) else []) for c in _configs(manager, m, seen)]


def _local_files(dataset_kwargs: Any, split: Optional[str] = None) -> list[Path]:
    """The local paths in a YAML's dataset_kwargs.data_files (a path, a list, or a map of split to either)."""
    data = dataset_kwargs.get("data_files") if isinstance(dataset_kwargs, dict) else None
    if isinstance(data, dict):
        data = data.get(split) if split else [v for vs in data.values() for v in (vs if isinstance(vs, list) else [vs])]
    return [Path(v) for v in (data if isinstance(data, list) else [data]) if isinstance(v, str) and "://" not in v]


def _check_rows(task: Any) -> None:
    """What lm-eval accepts silently in a task on local files (the harness's hub tasks are its own): a row without a
    field the templates use (datasets fills in null, rendered "None") and a gold outside its choices (a warning,
    scored wrong). ConfigError naming the row."""
    import jinja2.meta  # comes with lm-eval

    config = task.config
    split = config.test_split if task.has_test_docs() else config.validation_split
    if not (files := _local_files(config.dataset_kwargs, split)):
        return
    # The fields doc_to_text, doc_to_target and doc_to_choice read: a field's name, or a template's variables.
    texts = [t for t in (config.doc_to_text, config.doc_to_target, config.doc_to_choice) if isinstance(t, str)]
    used = {f for t in texts for f in {t} | jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(t))}
    used &= set(getattr(task, "features", None) or [])
    for row, doc in enumerate(task.eval_docs, 1):
        missing = sorted(f for f in used if f in doc and doc[f] is None)
        if problem := f"it has no {', '.join(missing)}" if missing else _gold_problem(task, doc):
            raise ConfigError(f"lm-eval task {config.task}: {', '.join(map(str, files))} row {row} of its {split} "
                              f"split: {problem}. Every row needs the fields its YAML's doc_to_text, doc_to_target "
                              f"and doc_to_choice use, and a multiple-choice gold inside its choices; mend or "
                              f"remove that row.")


def _gold_problem(task: Any, doc: Any) -> Optional[str]:
    """Why a multiple-choice row's gold is none of its choices (an int indexes them, a string is one), or None."""
    if task.OUTPUT_TYPE != "multiple_choice":
        return None
    text, target, choices = task.doc_to_text(doc), task.doc_to_target(doc), task.doc_to_choice(doc)
    gold = text if isinstance(text, int) else target  # several contexts (winogrande): the text is the gold index
    for g in gold if isinstance(gold, list) else [gold]:
        if not (0 <= g < len(choices) if isinstance(g, int) else g in choices):
            return f"its gold {g!r} is not one of its {len(choices)} choices (an index 0-{len(choices) - 1}, or " \
                   f"one of the choice strings)"
    return None


def task_records(results: dict[str, Any], step: Optional[int], source: str, **extra: Any) -> list[dict[str, Any]]:
    """One evals.jsonl record per task (groups too) from simple_evaluate's results."""
    out = []
    for task, row in results["results"].items():
        numbers = {k.split(",")[0]: v for k, v in row.items() if k not in ("alias", "sample_len") and is_number(v)}
        scores = {m: v for m, v in numbers.items() if not m.endswith("_stderr")}
        better = results.get("higher_is_better", {}).get(task, {})
        out.append(_record(step, source, task, scores, results.get("n-samples", {}).get(task, {}).get("effective"),
                           {m.removesuffix("_stderr"): v for m, v in numbers.items() if m.endswith("_stderr")},
                           {m: better.get(m) for m in scores}, num_fewshot=results.get("n-shot", {}).get(task),
                           **extra))
    return out


def _record(step: Optional[int], source: str, task: str, scores: dict[str, float], samples: Optional[int],
            stderr: Optional[dict] = None, better: Optional[dict] = None, **extra: Any) -> dict[str, Any]:
    return {"step": step, "time": time.time(), "source": source, "task": task, "scores": scores,
            "stderr": stderr or {}, "higher_is_better": better or {}, "samples": samples, **extra}


def record_tasks(run_dir: Optional[Path], records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Append to evals.jsonl and TensorBoard the records the run does not hold yet; return those it held."""
    if run_dir is None:
        return []
    done = recorded(run_dir)
    held = [r for r in records if "error" not in r and evaluation_key(r) in done]
    new = [r for r in records if "error" in r or evaluation_key(r) not in done]
    for record in new:
        append_jsonl(run_dir / EVALS_FILE, record)
    from torch.utils.tensorboard import SummaryWriter  # its own events file beside the trainer's

    with SummaryWriter(log_dir=str(run_dir / TB_DIR), filename_suffix=".tasks") as writer:
        for r in (r for r in new if r["step"] is not None):
            for metric, value in r["scores"].items():
                writer.add_scalar(f"tasks/{r['task']}/{metric}", value, r["step"])
    return held


def task_lines(records: list[dict[str, Any]]) -> list[str]:
    """One line per task: each metric with its stderr, or why its scoring failed."""
    return [f"{r['task']} (step {r['step']}): not scored: {r['error']}" if "error" in r else
            f"{r['task']} (step {r['step']}, {r['samples']} docs): " + ", ".join(
                f"{m} {v:.4f}" + (f" ± {r['stderr'][m]:.4f}" if isinstance(r["stderr"].get(m), float) else "")
                for m, v in r["scores"].items()) for r in records]


@dataclass
class TaskSpec:
    """What to score: lm-eval tasks (names, groups, or YAMLs in include_path) and/or a CORE bundle."""

    tasks: list[str] = field(default_factory=list)
    include_path: Optional[str] = None
    limit: Optional[int] = None  # documents per task (and items per CORE task); None: all
    num_fewshot: Optional[int] = None  # None: each task's own
    core_dir: Optional[str] = None
    batch_size: int = 32

    def __bool__(self) -> bool:
        return bool(self.tasks or self.core_dir)

    def parts(self) -> list[TaskSpec]:
        """The lm-eval tasks and the CORE bundle as two specs, so one failing in training keeps the other's scores."""
        return [part for part in (replace(self, core_dir=None), replace(self, tasks=[])) if part]

    def names(self) -> list[str]:
        """The tasks as evals.jsonl names them: each lm-eval task or group given, and `core` for the bundle."""
        return self.tasks + (["core"] if self.core_dir else [])


def score_model(model: Llama, tokenizer: Tokenizer, rt: Runtime, spec: TaskSpec, step: Optional[int], source: str,
                **extra: Any) -> list[dict[str, Any]]:
    """Every task of `spec` on one model: evals.jsonl records, CORE's as `core/<task>` and `core` (the centered mean).
    The bundle is read first: a broken one stops before the lm-eval tasks take their time. The RNG states are put
    back (the harness seeds Python's, numpy's and torch's): scoring during training leaves the run alone."""
    bundle = core.read_bundle(spec.core_dir, spec.limit or 0) if spec.core_dir else None
    was_training, rng = model.training, rt.rng_state()
    model.eval()
    t0 = time.perf_counter()
    try:
        records = []
        if spec.tasks:
            lm = lm_class()(model=model, tokenizer=tokenizer, rt=rt, batch_size=spec.batch_size)
            results = evaluate_tasks(lm, spec.tasks, spec.include_path, spec.limit, spec.num_fewshot)
            records += task_records(results, step, source, **extra)
        if bundle is not None:
            result = core.evaluate_core(model, tokenizer, bundle, rt, batch_size=spec.batch_size)
            records += [_record(step, source, f"core/{label}", {"acc": t["accuracy"], "centered": t["centered"]},
                                t["n"], better={"acc": True, "centered": True}, random_baseline=t["random_baseline"],
                                **extra) for label, t in result["tasks"].items()]
            records.append(_record(step, source, "core", {"core": result["core"]}, sum(
                t["n"] for t in result["tasks"].values()), better={"core": True}, **extra))
    finally:
        model.train(was_training)
        rt.set_rng_state(rng)
    return [{**r, "seconds": time.perf_counter() - t0} for r in records]  # the whole pass, outside any training clock


class TaskScorer:
    """eval.tasks and eval.core on the live model every eval.tasks_every steps and after the last, once that step's
    checkpoint is saved, outside the training clock. On a one-process view of the runtime: a whole model is scored
    by the main rank while the others wait; a sharded one by every rank in lockstep (parallel.lockstep), the main
    rank recording. A failure on any rank is a warning and a record naming the task and cause; training goes on."""

    def __init__(self, cfg: Config, rt: Runtime, model: Llama, tokenizer: Tokenizer):
        e = cfg.eval
        self.spec = TaskSpec(list(e.tasks), e.tasks_path or None, e.tasks_limit or None, None, e.core or None)
        self.cfg, self.rt, self.model, self.tokenizer = cfg, rt, model, tokenizer
        self.solo = replace(rt, rank=0, local_rank=0, world_size=1, local_world_size=1)
        self.sharded = parallel.is_sharded(model)
        self.seconds, self.last_step = 0.0, None
        if not self.spec:  # every rank reads the same config: no collective for a run without tasks
            return
        # Refused before the first step by every rank that scores; all raise alike: none waits at a collective.
        mine = None
        if rt.is_main or self.sharded:
            try:
                check_tasks(self.spec)
            except ConfigError as e:
                mine = e
        if error := next((e for e in rt.gather_objects(mine) if e is not None), None):
            raise error

    def due(self, step: int) -> bool:
        every = self.cfg.eval.tasks_every
        return bool(self.spec) and bool(every) and step % every == 0 and 0 < step < self.cfg.train.max_steps

    def run(self, step: int, weights: Optional[contextlib.AbstractContextManager[str]] = None) -> None:
        """Score at `step` with `weights` swapped in (the validator's, yielding their name), else the model's own."""
        t0 = time.perf_counter()
        with weights or contextlib.nullcontext("model") as name:
            if self.rt.is_main or self.sharded:
                self._score(step, name)
        self.rt.barrier()
        self.seconds += time.perf_counter() - t0
        self.last_step = step

    def _score(self, step: int, weights: str) -> None:
        """Score and record each part. Nothing raised here may reach the loop: the other ranks wait at the barrier."""
        records = [{**r, "weights": weights} for part in self.spec.parts() for r in self._score_part(part, step)]
        if not self.rt.is_main:
            return
        try:
            record_tasks(self.cfg.run_dir, records)
        except Exception as e:  # e.g. evals.jsonl replaced by a link, or damaged, during the run
            log.warning("step %6d | task scores not recorded in %s: %s", step, EVALS_FILE, e)
        for line in task_lines(records):
            log.info("step %6d | %s", step, line)

    def _score_part(self, part: TaskSpec, step: int) -> list[dict[str, Any]]:
        """The part's records, or one failure record per task, alike on every rank: sharded, a failure on any rank
        fails the part (its scores may be cut short), named by the first rank whose own error (not Broken) it was."""
        records, mine = [], None
        try:
            with parallel.lockstep(self.model, self.rt):
                records = score_model(self.model, self.tokenizer, self.solo, part, step, "train")
        except Exception as e:  # KeyboardInterrupt passes: Ctrl-C still stops the run
            mine = (isinstance(e, parallel.Broken), str(e) if isinstance(e, ConfigError) else f"{type(e).__name__}: {e}")
        mine_everywhere = self.rt.gather_objects(mine) if self.sharded else [mine]
        if not (causes := [(c[0], rank, c[1]) for rank, c in enumerate(mine_everywhere) if c is not None]):
            return records
        _, rank, cause = min(causes)  # an own error before a Broken one, then the lowest rank
        cause = cause if rank == 0 else f"rank {rank}: {cause}"
        if self.rt.is_main:
            log.warning("step %6d | %s not scored, training goes on: %s", step, ", ".join(part.names()), cause)
        return [_record(step, "train", name, {}, None, error=cause) for name in part.names()]


def score_checkpoint(path: str | Path, spec: TaskSpec, device: str = "auto", precision: str = "run",
                     weights: str = "run") -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """`nanopt eval PATH --tasks/--core`: load, score, and record in its run directory (if any). Returns the records
    and those the run's evals.jsonl already held from the same weights (not appended)."""
    if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
        raise ConfigError("--tasks and --core run in one process; start `nanopt eval` without torchrun.")
    model, tok, rt, loaded = task_model(str(path), device=device, precision=precision, weights=weights)
    assert loaded is not None  # loaded from path
    try:
        records = score_model(model, tok, rt, spec, loaded.step, "nanopt eval",
                              checkpoint=str(loaded.source), weights=loaded.weights,
                              weights_crc32=weights_crc32(loaded.source, loaded.weights_file),
                              limit=spec.limit, precision=rt.precision,
                              **({"averaged_from": loaded.averaged_from} if loaded.averaged_from else {}))
        held = record_tasks(loaded.run_dir, records)
    finally:
        runtime.teardown()
    return records, held


if __name__ == "__main__":  # lm-eval's own CLI, `nanopt` registered: python -m nanopt.evals.tasks run --model nanopt
    lm_class()
    if sys.argv[1:2] == ["run"] and not any(a.startswith("--device") for a in sys.argv):
        sys.argv += ["--device", "auto"]  # the harness's default is cuda:0; nanopt picks what this machine has
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()
