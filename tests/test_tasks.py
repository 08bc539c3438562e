"""nanopt models inside lm-evaluation-harness: per-request parity with the harness's own `hf` model on an export,
greedy generation equal to sampling at temperature 0, the boundary for task input, and what a run directory gets."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import CPU, fork_ranks

from nanopt.config import Config, ModelConfig, load_config, parse_overrides
from nanopt.data.tokenizer import get_tokenizer
from nanopt.distributed import parallel
from nanopt.distributed.runtime import Runtime
from nanopt.errors import ConfigError
from nanopt.evals import core_benchmark as core
from nanopt.evals.generate import generate
from nanopt.evals.scoring import continuation_scores
from nanopt.evals.taskgen import make_tasks
from nanopt.evals.tasks import (TaskScorer, _self_contained, _task_manager, evaluate_tasks, lm_class, record_tasks,
                                task_records)
from nanopt.hf import export_model
from nanopt.recipe.model import build_model

torch.set_num_threads(1)
pytestmark = pytest.mark.usefixtures("offline")  # conftest: no hub

TEXT = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in "
        "want of a wife. However little known the feelings or views of such a man may be on his first entering "
        "a neighbourhood, this truth is so well fixed in the minds of the surrounding families. ") * 3
PAIRS = [("It is a truth", " universally acknowledged"), ("a single man", " in possession"),
         ("", "However little known"), ("must be in want of a", " wife."), ("x", " y z w v u t s r q")]


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    """A random plain Llama with a byte-level BPE tokenizer trained here, exported with nanopt's exporter."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator([TEXT] * 5, trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>"],
                                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    root = tmp_path_factory.mktemp("harness")
    PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>",
                            clean_up_tokenization_spaces=False).save_pretrained(root / "tok")
    torch.manual_seed(0)
    model = build_model(ModelConfig(vocab_size=400, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128,
                                    max_seq_len=64))
    with torch.no_grad():  # larger weights than the init, so log-probabilities differ visibly between tokens
        for p in model.parameters():
            p.mul_(3.0)
    export_model(model, root / "hf", tokenizer=str(root / "tok"))
    return root / "hf"


def instances(kind: str, args: list[tuple]) -> list:
    from lm_eval.api.instance import Instance

    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


@pytest.fixture(scope="module")
def both(exported) -> tuple:
    """nanopt's model and the harness's own `hf` model on the same export."""
    from lm_eval.models.huggingface import HFLM

    return (lm_class()(path=str(exported), device="cpu", precision="fp32", add_bos_token=False, batch_size=2),
            HFLM(pretrained=str(exported), device="cpu", batch_size=3, dtype="float32"))


def test_loglikelihoods_and_rolling_ones_equal_the_harness_hf_model_request_by_request(both):
    a, b = (lm.loglikelihood(instances("loglikelihood", PAIRS)) for lm in both)
    assert [g for _, g in a] == [g for _, g in b]
    assert max(abs(x - y) for (x, _), (y, _) in zip(a, b)) <= 1e-4
    assert len({round(x, 3) for x, _ in a}) == len(PAIRS)  # distinct figures: the comparison is not vacuous
    # Contexts past the 64-token context are cropped on the left like the harness crops them.
    (x, _), (y, _) = (lm.loglikelihood(instances("loglikelihood", [("word " * 80, " end")]))[0] for lm in both)
    assert abs(x - y) <= 1e-4
    texts = [(TEXT[:90],), (TEXT,), ("short",)]  # TEXT spans several 64-token windows
    a, b = (lm.loglikelihood_rolling(instances("loglikelihood_rolling", texts)) for lm in both)
    assert max(abs(x - y) for x, y in zip(a, b)) <= 1e-3 and all(x < 0 for x in a)


def test_batching_does_not_change_scores():
    torch.manual_seed(1)
    model = build_model(ModelConfig(vocab_size=50, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64,
                                    max_seq_len=16)).eval()
    requests = [(list(range(1, n)), [7, 8, 9][: 1 + n % 3]) for n in range(2, 30)]  # some past the context
    one = continuation_scores(model, requests, CPU, batch_size=1)
    many = continuation_scores(model, requests, CPU, batch_size=8)
    assert [g for _, g in one] == [g for _, g in many]
    assert max(abs(a - b) for (a, _), (b, _) in zip(one, many)) < 1e-5
    # By hand for one request: the summed log-softmax of the continuation's tokens.
    ctx, cont = requests[3]
    ids = torch.tensor([ctx + cont])
    lp = torch.log_softmax(model(ids[:, :-1])[0].float(), -1)
    expected = sum(lp[len(ctx) - 1 + i, t].item() for i, t in enumerate(cont))
    assert one[3][0] == pytest.approx(expected, abs=1e-5)
    # BPE can fold a short continuation into the context's last token: nothing to score, as the harness's hf says.
    assert continuation_scores(model, [([1, 2, 3], []), ([4, 5], [6])], CPU)[0] == (0.0, True)


def test_generate_until_is_greedy_sampling_cut_at_the_stop_string():
    torch.manual_seed(2)
    model = build_model(ModelConfig(vocab_size=257, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64,
                                    max_seq_len=64))
    lm = lm_class()(model=model, tokenizer="byte", rt=CPU)
    prompt = "To be, or not"
    ids = [256] + list(prompt.encode())
    reference = generate(model.eval(), torch.tensor([ids]), 12, temperature=0, use_cache=False)[0, len(ids):]
    text = bytes(i for i in reference.tolist() if i < 256).decode("utf-8", errors="replace")
    (full,) = lm.generate_until(instances("generate_until", [(prompt, {"until": [], "max_gen_toks": 12})]))
    assert full == text
    stop = text[3:5]
    (cut,) = lm.generate_until(instances("generate_until", [(prompt, {"until": [stop], "max_gen_toks": 12})]))
    assert cut == text.split(stop)[0]


def test_records_land_in_the_run_directory_and_tensorboard(tmp_path):
    results = {"results": {"mc": {"alias": "mc", "acc,none": 0.5, "acc_stderr,none": 0.1, "sample_len": 10}},
               "higher_is_better": {"mc": {"acc": True}}, "n-samples": {"mc": {"effective": 10}},
               "n-shot": {"mc": 0}}
    records = task_records(results, 8, "nanopt eval", checkpoint="c")
    assert records[0]["scores"] == {"acc": 0.5} and records[0]["stderr"] == {"acc": 0.1}
    record_tasks(tmp_path, records)
    line = json.loads((tmp_path / "evals.jsonl").read_text())
    assert (line["task"], line["step"], line["higher_is_better"], line["samples"]) == ("mc", 8, {"acc": True}, 10)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb")).Reload()
    assert [(e.step, e.value) for e in events.Scalars("tasks/mc/acc")] == [(8, 0.5)]


@pytest.fixture(scope="module")
def tiny_lm():
    return lm_class()(model=build_model(ModelConfig(vocab_size=257, dim=16, n_layers=1, n_heads=2, n_kv_heads=1,
                                                    ffn_dim=32, max_seq_len=64)), tokenizer="byte", rt=CPU)


# lm-eval indexes its tasks for seconds, once per include path and process: task_dir's index also serves
# e2e/test_tasks_during_training.py's unknown task.
@pytest.mark.slow
def test_unknown_task_and_missing_path_are_one_paragraph(tmp_path, task_dir, tiny_lm):
    with pytest.raises(ConfigError, match="unknown lm-eval task.*no_such_task"):
        evaluate_tasks(tiny_lm, ["no_such_task"], include_path=str(task_dir))
    with pytest.raises(ConfigError, match="not a directory"):
        evaluate_tasks(tiny_lm, ["x"], include_path=str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="does not exist"):
        lm_class()(path=str(tmp_path / "nothing"))


@pytest.mark.parametrize("error, raised, words", [
    ("DatasetGenerationError", ConfigError, r"nanopt_mc.*nanopt_mc\.jsonl.*DatasetGenerationError"),
    (StopIteration(), ConfigError, "no rows"), (RuntimeError("CUDA error"), RuntimeError, "CUDA error")])
def test_a_harness_failure_on_task_data_while_scoring_is_caught_at_the_boundary(task_dir, monkeypatch, tiny_lm, error,
                                                                                raised, words):
    """What the harness raises on data while it scores is bad input naming the task and its file (the damaged
    inputs: e2e/test_bad_task_input.py); a failure of the model or device (RuntimeError) passes unchanged."""
    import datasets.exceptions
    import lm_eval

    error = datasets.exceptions.DatasetGenerationError("generation") if isinstance(error, str) else error
    def simple_evaluate(**kwargs):
        raise error
    monkeypatch.setattr(lm_eval, "simple_evaluate", simple_evaluate)
    with pytest.raises(raised, match=words):
        evaluate_tasks(tiny_lm, ["nanopt_mc"], str(task_dir))


def test_tasks_all_in_the_include_path_skip_indexing_lm_evals_own(tmp_path, monkeypatch):
    """Tasks and groups whose every member is in --include-path resolve without lm-eval's ~15,000 YAMLs (seconds
    saved per process); a group that names one of lm-eval's own tasks still gets the whole index."""
    pytest.importorskip("lm_eval", reason="lm-eval is an optional extra (pip install -e '.[eval]')")
    import lm_eval.tasks

    make_tasks(tmp_path / "t", n=8)
    (tmp_path / "t" / "mixed.yaml").write_text("group: mixed\ntask:\n  - nanopt_mc\n  - hellaswag\n")
    built = []
    real = lm_eval.tasks.TaskManager
    monkeypatch.setattr(lm_eval.tasks, "TaskManager", lambda **kw: built.append(kw) or real(**kw))
    manager = _task_manager(["nanopt_tasks", "nanopt_mc"], str(tmp_path / "t"))
    assert [kw.get("include_defaults", True) for kw in built] == [False]
    assert manager.match_tasks(["nanopt_tasks"]) == ["nanopt_tasks"]
    assert not _self_contained(manager.task_index, ["mixed"]) and not _self_contained(manager.task_index, ["nope"])


# ---------------------------------------------------------------- eval.core / eval.tasks during a sharded run
SCORED = {"dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 64, "max_seq_len": 256}


def _scorer_config(bundle: Path, run_dir: Path, parallel: str = "fsdp") -> Config:
    run_dir.mkdir(exist_ok=True)
    return load_config(None, parse_overrides([
        f"--runtime.parallel={parallel}", f"--eval.core={bundle}", "--eval.tasks_limit=4", f"--run.dir={run_dir}",
        "--train.precision=fp32", *(f"--model.{k}={v}" for k, v in SCORED.items())]))


def _sharded_scorer_worker(rank: int, world: int, store: str, bundle: str, run_dir: str) -> None:
    """One gloo rank of an fsdp run scoring CORE twice through TaskScorer: at step 2 rank 1's scorer raises on its
    second batch (after forwards the others ran too), at step 4 every rank scores."""
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    cfg = _scorer_config(Path(bundle), Path(run_dir))
    rt = Runtime(kind="cpu", device=torch.device("cpu"), rank=rank, local_rank=rank, world_size=world,
                 local_world_size=world, precision="fp32")
    torch.manual_seed(0)
    model = build_model(cfg.model)
    parallel.shard(model, cfg, rt)
    scorer = TaskScorer(cfg, rt, model, get_tokenizer("byte"))
    real, calls = core.token_scores, [0]

    def fails_on_rank_one(*args, **kwargs):
        calls[0] += 1
        if rank == 1 and calls[0] == 2:
            raise RuntimeError("the harness broke here")
        return real(*args, **kwargs)

    core.token_scores = fails_on_rank_one
    scorer.run(2)
    core.token_scores = real
    scorer.run(4)
    torch.distributed.destroy_process_group()


def test_a_sharded_model_is_scored_on_every_rank_as_one_process_scores_it_and_survives_one_rank_failing(tmp_path,
                                                                                                       task_dir):
    """eval.core under fsdp on 2 forked gloo ranks: every rank runs the same forwards in lockstep (each gathers
    weights from both), the main rank records. A failure on rank 1 alone, mid-scoring, fails the part on both
    (no hang: the fork has a deadline), recorded once with rank 1's cause; the next scoring is whole and records
    what one process scores on the same weights."""
    import torch.distributed.fsdp  # noqa: F401 (here, not in each fork: seconds of import)

    bundle = task_dir / "core"
    cfg = _scorer_config(bundle, tmp_path / "one", parallel="ddp")
    torch.manual_seed(0)
    TaskScorer(cfg, CPU, build_model(cfg.model), get_tokenizer("byte")).run(4)  # first: the forks inherit its imports
    expected = [json.loads(line) for line in (tmp_path / "one" / "evals.jsonl").read_text().splitlines()]
    fork_ranks(_sharded_scorer_worker, 2, (2, str(tmp_path / "store"), str(bundle), str(tmp_path / "run")), timeout=120)
    records = [json.loads(line) for line in (tmp_path / "run" / "evals.jsonl").read_text().splitlines()]
    failed, scored = [r for r in records if r["step"] == 2], [r for r in records if r["step"] == 4]
    assert [r["task"] for r in failed] == ["core"]
    assert failed[0]["error"] == "rank 1: RuntimeError: the harness broke here"
    assert [(r["task"], r["scores"]) for r in scored] == [(r["task"], r["scores"]) for r in expected]
    assert len(scored) > 2 and "error" not in json.dumps(scored)
