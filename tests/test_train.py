"""The training loop's pieces (nanopt/training/train.py): each component decides when it acts, compiling follows the
DDP split switch and the seq_len schedule, DDP's gradients stay bucket views. Whole runs: e2e/test_training_run.py."""
from __future__ import annotations

import json
import sys
import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from conftest import free_port, small_overrides
from torch.nn.parallel import DistributedDataParallel as DDP

from nanopt.config import ModelConfig, TrainConfig, load_config, parse_overrides, to_yaml
from nanopt.distributed import parallel, runtime
from nanopt.errors import ConfigError
from nanopt.evals.tasks import TaskSpec
from nanopt.main import run
from nanopt.recipe.model import build_model
from nanopt.training import train
from nanopt.training.checkpoint import Checkpointer
from nanopt.training.plan import build_plan
from nanopt.training.train import TaskScorer, Trainer, Validator, train_step


TINY = ModelConfig(vocab_size=61, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=64)


def test_each_component_decides_when_it_acts_and_the_pause_asks_them():
    """One cadence rule per component (the last step's come from finish()); the step before any is timed to the end."""
    cfg = load_config(None, parse_overrides(small_overrides(**{
        "train.max_steps": 12, "eval.every": 4, "checkpoint.every": 3, "eval.tasks": "t", "eval.tasks_every": 5})))
    ckpt, evaluator, tasks = (cls.__new__(cls) for cls in (Checkpointer, Validator, TaskScorer))  # only their cadence
    ckpt.cfg = evaluator.cfg = tasks.cfg = cfg
    tasks.spec = TaskSpec(["t"])
    steps = range(1, 13)
    assert [s for s in steps if ckpt.should_save(s)] == [3, 6, 9]
    assert [s for s in steps if evaluator.due(s)] == [4, 8]
    assert evaluator.due(0)  # the initial weights' loss, the curve's first point
    cfg.eval.at_start = False
    assert not evaluator.due(0) and [s for s in steps if evaluator.due(s)] == [4, 8]
    cfg.eval.at_start, cfg.eval.every = True, 0
    assert not evaluator.due(0)  # no periodic validation: none at the start either
    cfg.eval.every = 4
    assert [s for s in steps if tasks.due(s)] == [5, 10]  # and the last step's, from finish()
    run = SimpleNamespace(cfg=cfg, evaluator=evaluator, ckpt=ckpt, tasks=tasks)
    assert [s for s in steps if Trainer.pause_follows(run, s)] == [3, 4, 5, 6, 8, 9, 10, 12]


@pytest.mark.parametrize("stopped", [False, True])
def test_a_finished_runs_rerun_with_a_changed_result_key_is_refused_naming_it_and_the_fixes(tmp_path, stopped):
    """Before: "is finished; nothing to train", exit 0, though the new target was never used."""
    cfg = load_config(None, parse_overrides([f"--run.dir={tmp_path}", "--train.target_val_loss=4.0",
                                             f"--train.stop_at_target={stopped}"]))
    (tmp_path / "config.yaml").write_text(to_yaml(cfg))
    steps = 120 if stopped else cfg.train.max_steps
    (tmp_path / "summary.json").write_text(json.dumps({"steps": steps, "stopped_at_target": stopped}))
    assert train.finished_summary(cfg)["steps"] == steps  # its own command: the summary
    cfg.train.target_val_loss = 1.6
    with pytest.raises(ConfigError) as refused:
        train.finished_summary(cfg)
    text = str(refused.value)
    assert all(words in text for words in (
        f"{tmp_path} holds a finished run", "train.target_val_loss: 4.0 in the checkpoint, 1.6 now",
        "Set `run.name` (or `run.dir`)", "run the config it used", "`--checkpoint.allow_changes=KEY[,KEY...]`")), text
    # Stopped at its target, a larger max_steps would not train on: not offered; what does continue it is.
    assert ("A larger `train.max_steps` continues the run." in text) is not stopped
    assert ("`--train.stop_at_target=false` continues the run" in text) is stopped


def test_a_run_stopped_at_its_target_continues_as_its_advice_says_and_the_loop_calls_the_step(tmp_path, capsys,
                                                                                                monkeypatch):
    """Before: "nothing to train (a longer run: raise train.max_steps ...)", and a raised max_steps was refused. From
    train() to train_step the stack holds only the loop, Trainer.train (issue 51: there were five)."""
    step, between = train.train_step, []

    def recorded(*args):
        frame, names = sys._getframe(1), []
        while frame.f_code is not train.train.__code__:  # up to the module's train()
            names.append(frame.f_code.co_name)
            frame = frame.f_back
        between.append(names)
        return step(*args)

    monkeypatch.setattr(train, "train_step", recorded)  # what the Trainer hands rt.backend.compile_step
    args = [*small_overrides(**{"train.precision": "fp32", "train.max_steps": 6, "eval.every": 2,
                                "checkpoint.every": 2, "log.tensorboard": "false", "train.target_val_loss": 100.0,
                                "train.stop_at_target": "true"}), f"--run.dir={tmp_path}"]
    assert run(args) == 0
    assert json.loads((tmp_path / "summary.json").read_text())["stopped_at_target"] is True
    capsys.readouterr()
    assert run(args) == 0  # its own command: nothing to train, and how to go on
    assert "--train.stop_at_target=false continues it to train.max_steps" in capsys.readouterr().out
    assert run([*args, "--train.max_steps=8"]) == 2  # refused, naming the same way on
    assert "`--train.stop_at_target=false` continues the run" in capsys.readouterr().err
    assert run([*args, "--train.stop_at_target=false"]) == 0  # the advice, followed
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 6 and not summary["stopped_at_target"]
    assert between == [["train"]] * 6  # one call per step trained, over the first run and the continued one


def test_compile_follows_the_ddp_split_switch_and_a_seq_len_schedule_compiles_static_shapes(caplog):
    """train.compile_ddp_split is dynamo's optimize_ddp: split by default, one graph under train.fp8, saying why;
    several sequence lengths compile with static shapes and room for a graph per length."""
    # torch's own patch, not monkeypatch: pytest's undo deletes an attribute it did not find in the module's
    # __dict__, and a deleted torch._dynamo.config entry is gone for the session (every later DDP() raises).
    model, schedule = torch.nn.Linear(4, 4), [[i, 8 * (i + 1)] for i in range(8)]
    with torch._dynamo.config.patch(optimize_ddp=True, recompile_limit=8):
        for t, ddp, split, limit, said, unsaid in [  # in order: recompile_limit stays what the row before left
                (TrainConfig(compile_ddp_split=False), False, False, 8, "", None),
                (TrainConfig(seq_len=64, seq_len_schedule=schedule), False, True, 16, "", None),
                (TrainConfig(fp8="tensorwise"), True, False, 16, "pytorch/pytorch#158936", None),
                (TrainConfig(fp8="tensorwise", compile_ddp_split=True), True, True, 16, "", "one graph")]:  # asked
            caplog.clear()
            with caplog.at_level("INFO", logger="nanopt"):
                train.compiled(model, t, build_plan(t, 1), ddp=ddp)
            assert torch._dynamo.config.optimize_ddp is split and torch._dynamo.config.recompile_limit == limit
            assert said in caplog.text and (unsaid is None or unsaid not in caplog.text), caplog.text


def test_a_sharded_model_is_compiled_per_block_one_graph_per_sequence_length_for_the_training_forward(monkeypatch):
    """Sharded, the training forward runs one compiled callable per block (Llama.training_blocks), the module tree and
    state_dict keys the eager model's; unsharded, the whole model is compiled. 3 blocks, 3 lengths (16 again at the
    end) -> 3 graphs, not 9 and not a dynamic one (dynamo's eager backend); evaluation (no_grad) compiles nothing."""
    model = build_model(TINY)
    keys, t = list(model.state_dict()), TrainConfig()
    assert isinstance(train.compiled(model, t, build_plan(t, 1)), torch._dynamo.eval_frame.OptimizedModule)
    assert model.training_blocks is None
    monkeypatch.setattr(parallel, "is_sharded", lambda m: m is model)
    assert train.compiled(model, t, build_plan(t, 1)) is model
    assert [b._orig_mod for b in model.training_blocks] == list(model.layers)
    assert list(model.state_dict()) == keys
    model = build_model(TINY)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    train.compile_blocks(model, dynamic=False, backend="eager")
    for length in (16, 32, 8, 16):
        x = torch.randint(0, 61, (2, length))
        model(x, x).backward()
    with torch.no_grad():
        model(x, x)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 3
    torch._dynamo.reset()


def test_gradients_accumulate_in_ddp_buckets_not_beside_them(monkeypatch):
    """zero_grad(set_to_none) freed the bucket views each step, so the no_sync micro-steps allocated a second set
    and the last copied it in (GPU review finding 1: 4.6 GiB and a 4.9 GB copy per step at 1B). DDP over gloo,
    world size 1, built as train builds it, which warns nothing (torch 2.13's FutureWarning on broadcast_buffers)."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        cfg = load_config(None, parse_overrides(small_overrides()))
        model = build_model(cfg.model, "cpu")
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the keyword train uses is torch's current one: no FutureWarning per rank
            ddp = DDP(model, gradient_as_bucket_view=True, **parallel.no_forward_buffer_sync())
        assert not ddp.broadcast_buffers  # no broadcast before each forward, under either keyword
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        storages: list[int] = []  # the storage each gradient lives in, as autograd accumulates into it
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(lambda p: storages.append(p.grad.untyped_storage().data_ptr()))
        batches = [(torch.randint(0, 257, (4, 32)), torch.randint(0, 257, (4, 32))) for _ in range(2)]
        per_step = []
        for _ in range(3):
            storages.clear()
            train_step(ddp, optimizer, batches, runtime.init("cpu", "fp32", 1), 1.0)
            per_step.append(set(storages))
    finally:
        dist.destroy_process_group()
    params = len(list(model.parameters()))
    assert len(per_step[0]) == params  # the first step allocates them; DDP then makes them views of its bucket
    assert per_step[1] == per_step[2] and len(per_step[1]) < params, [len(s) for s in per_step]
