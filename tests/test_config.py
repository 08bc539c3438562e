"""Config loading, overrides and the errors a user sees."""
from __future__ import annotations

import operator

import pytest
import yaml

from nanopt.config import (ConfigError, config_from_dict, configs_dir, load_config, parse_overrides, resolve,
                           resume_changes, to_yaml)
from nanopt.main import run
from nanopt.training.plan import build_plan


@pytest.mark.parametrize("path", sorted(configs_dir().glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_loads_and_resolves(path):
    cfg = load_config(path)  # and sets no key its switch leaves ignored
    world = 8 if path.stem in ("1b", "8b") else 1
    resolve(cfg, world)
    assert all(stage.accum >= 1 for stage in build_plan(cfg.train, world).stages)


@pytest.mark.parametrize("override, refused", [
    ("--data.source=/data/shards", True), ("--train.target_val_loss=1.6", True), ("--profile.enabled=true", True),
    ("--eval.tasks=hellaswag", True), ("--train.max_steps=50", True),
    ("--runtime.threads=3", False), ("--checkpoint.every=7", False), ("--run.name=other", False),
])
def test_a_finished_run_refuses_a_resume_safe_key_its_rerun_would_ignore(override, refused):
    """Before, a finished run's re-run swallowed every resume-safe change ("nothing to train", exit 0): a new
    corpus, target, profiling or tasks silently did nothing. Where the run goes on, they stay free."""
    saved = load_config(None).to_dict()
    name = override[2:].split("=")[0]
    cfg = load_config(None, parse_overrides([override]))
    assert resume_changes(saved, cfg) == []
    changes = resume_changes(saved, cfg, finished=True)
    assert [line.split(":")[0] for line in changes] == ([name] if refused else [])
    allowed = load_config(None, parse_overrides([override, f"--checkpoint.allow_changes={name}"]))
    assert resume_changes(saved, allowed, finished=True) == []


def test_no_config_is_the_embedded_tiny_default():
    assert load_config(None) == load_config(configs_dir() / "tiny.yaml")


@pytest.mark.parametrize("args, values", [
    (["--train.max_steps=50", "--train.lr", "1e-3", "--model.tie_embeddings=false", "--run.name=abc",
      "--train.global_batch_tokens=16_384"], [50, 1e-3, False, "abc", 16384]),
    (["--run.seed=4294967295", "--train.max_steps=1_000", "--log.every=1e2"], [4294967295, 1000, 100]),
    (["--train.max_steps=9007199254740993"], [9007199254740993]),  # 2^53 + 1
])
def test_overrides_convert_types_and_integers_exactly(args, values):
    cfg = load_config(None, parse_overrides(args))
    got = [operator.attrgetter(arg[2:].split("=")[0])(cfg) for arg in args if arg.startswith("--")]
    assert [(v, type(v)) for v in got] == [(v, type(v)) for v in values]


@pytest.mark.parametrize("world, accum", [(1, 4), (2, 2)])
def test_the_plan_derives_accumulation_from_world_size(world, accum):
    cfg = load_config(None, parse_overrides(["--train.micro_batch_size=4", "--train.seq_len=64",
                                             "--train.global_batch_tokens=1024"]))
    assert build_plan(resolve(cfg, world).train, world).stages[0].accum == accum


def test_a_saved_config_from_before_the_plan_or_with_a_key_its_switch_ignored_still_loads():
    """A checkpoint of configs/1b.yaml from before the switch rule holds profile.wait 5 with profiling off: eval,
    export and resume read it as written (the key changed nothing), while the same key given now is refused."""
    saved = load_config(None).to_dict()
    saved["train"]["grad_accum_steps"] = 2  # older versions derived it into the config their checkpoints hold
    assert config_from_dict(saved, "state.json") == load_config(None)
    saved["profile"]["wait"], saved["train"]["ema_start"] = 5, 7
    cfg = config_from_dict(saved, "state.json")
    assert (cfg.profile.wait, cfg.train.ema_start) == (5, 7)


def test_resolved_config_round_trips_through_yaml(tmp_path):
    cfg = load_config(None, parse_overrides(["--train.max_steps=7"]))
    path = tmp_path / "c.yaml"
    path.write_text(to_yaml(resolve(cfg, 1)))
    again = resolve(load_config(path), 1)
    assert again == cfg


# Bad input on the command line or in a config file: exit 2, one paragraph naming the key and what is valid, nothing
# written. Rows: (args, split at spaces, then the words the paragraph holds, by default the last argument's key);
# "{tmp}" is the test's directory. Choices, bounds and `must` rules are declared on each field (config.py `key`).
SCHEDULE = "`[[0, 8192], [300, 16384]]` in YAML, `0:8192,300:16384` on the command line"
LLAMA3 = "--model.rope_scaling=llama3 "
HUGE = 2**64
ROWS = [
    ("--train.max_step=5",), ("--trian.max_steps=5", "trian", "unknown section"), ("stray", "stray"),
    ("--train.learning_rate=0.1", "train.learning_rate", "unknown key"),
    ("--lr=0.1", "--lr=0.1", "--train.max_steps=50"),
    ("--train.max_steps", "--train.max_steps", "no value"),
    ("--config configs/tiny.yaml --config=configs/tiny.yaml", "two config files"),
    ("--model.dim=wide", "model.dim", "integer"), ("--train.lr=fast", "train.lr", "number"),
    ("--checkpoint.resume=maybe", "checkpoint.resume", "true or false"),
    ("--train.max_steps=five",), ("--model.tie_embeddings=maybe",), ("--train.max_steps=-3",),
    ("--train.max_steps=-5", "train.max_steps", "positive"), ("--checkpoint.keep=0", "checkpoint.keep", "positive"),
    ("--train.micro_batch_size=0", "train.micro_batch_size", "positive"),
    ("--train.loss_chunk_tokens=-1", "train.loss_chunk_tokens", "zero or positive"),
    ("--train.precision=fp8", "`train.precision` is 'fp8'; valid values: bf16, bf16-pure, fp32. bf16: autocast"),
    ("--prepare.sample_by=word", "prepare.sample_by", 'valid values: line, paragraph, document, or "" (empty).'),
    ("--model.attention=magic",), ("--runtime.device=tpu",), ("--model.mlp=gelu",), ("--optim.name=sgd",),
    ("--model.parametrization=µP",), ("--mfu.hardware=h1000",), ("--runtime.parallel=zero3",),
    ("--model.n_kv_heads=3",), ("--model.dim=100",), ("--model.n_heads=3", "model.dim", "n_heads"),
    ("--model.depth=6 --model.dim=512", "model.depth"), ("--train.grad_accum_steps=2",),
    ("--train.global_batch_tokens=1000",), ("--train.global_batch_tokens=100", "train.global_batch_tokens", "multiple"),
    ("--model.logit_softcap=-1",), ("--optim.muon_momentum=1.5",), ("--train.lr=nan",),
    ("--optim.matrix_lr=0", "`optim.matrix_lr` must be positive (or null for train.lr), got 0.0."),
    ("--train.beta2=1", "`train.beta2` must be in [0, 1), got 1.0."),
    ("--train.lr=inf", "`train.lr` must be finite and positive, got inf."),
    ("--train.eps=nan", "`train.eps` must be zero or positive"),  # was torch.optim.AdamW's ValueError traceback
    ("--train.ema_decay=1", "train.ema_decay", "in [0, 1)"),
    ("--eval.weights=ema", "eval.weights", "train.ema_decay", "is 0"),
    ("--train.target_val_bpb=2 --train.target_val_loss=1.5", "train.target_val_bpb"),
    ("--train.stop_at_target=true", "train.target_val_bpb"),
    ("--runtime.shard_group_size=2",),  # under ddp: it would be ignored
    ("--runtime.parallel=hsdp --runtime.shard_group_size=0",), ("--runtime.parallel=hsdp --runtime.device=xla",),
    ("--runtime.parallel=fsdp --runtime.device=xla",),
    # names and seeds that would escape the runs directory or overflow
    ("--run.name=..", "one directory name"), ("--run.name=.", "one directory name"), ("--run.seed=4294967296",),
    ("--run.seed=-1", "`run.seed` must be in [0, 2^32), got -1."),
    ("--eval.seed=99999999999999999999999", "`eval.seed` must be in [0, 2^32)"),  # was an OverflowError
    ("--prepare.shuffle_seed=-1", "`prepare.shuffle_seed` must be zero or positive"),  # was numpy's ValueError
    # llama3 scaling; before: NaN or 0 "diverged" (exit 3), a low factor of 0 a ZeroDivisionError, the others ran
    (LLAMA3 + "--model.rope_factor=nan", "`model.rope_factor` must be positive, got nan"),
    (LLAMA3 + "--model.rope_factor=0", "`model.rope_factor` must be positive"),
    (LLAMA3 + "--model.rope_low_freq_factor=0", "`model.rope_low_freq_factor` must be positive"),
    (LLAMA3 + "--model.rope_original_max_seq_len=0", "`model.rope_original_max_seq_len` must be positive"),
    (LLAMA3 + "--model.rope_low_freq_factor=4 --model.rope_high_freq_factor=4", "must be above `model.rope_low_freq"),
    # a schedule that is no list of rising pairs names both forms
    *((f"--train.batch_schedule={text}", "`train.batch_schedule` is ", SCHEDULE)
      for text in ("0:4096,3", "3:4096", "0:4096,0:8192", "0:0", "0:4096:5")),
    ("--profile.enabled=true --profile.ranks=", "`profile.ranks` is empty"),
    # A command-line byte that does not decode reaches Python as a lone surrogate; it was accepted, then the
    # tokenizer's UnicodeEncodeError ended the run with a traceback after training.
    ("--sample.prompt=caf\udcff", "`sample.prompt` is 'caf\\udcff', which holds bytes that are no UTF-8"),
    # Each key's `must` rule: a value the key cannot mean, refused naming the key and the fix.
    ("--run.name=a/b", "`run.name` must be one directory name"), ("--train.init_from=weights.pt", "it takes `hf:DIR`"),
    ("--eval.core={tmp}/none", "`eval.core` is '{tmp}/none', which is not a directory"),
    ("--eval.tasks=hellaswag --eval.tasks_path={tmp}/none",
     "which is not a directory. Give the directory (of task YAMLs)"),
    ("--checkpoint.allow_changes=train.lr,train.lrr", "names 'train.lrr', which is not a config key"),
    ("--checkpoint.allow_changes=train.lrr", "checkpoint.allow_changes", "train.lrr"),
    (["--prepare.dataset= "], "`prepare.dataset` is empty"), ("--prepare.text_field=", "must name the column"),
    # Every number is bounded by what exists (the bound's reason is a comment on its key); before, each of these
    # allocated until memory ran out, decoded for ever, was a traceback, or ended as "diverged ... lower the lr".
    *((("--profile.enabled=true " if name.startswith("profile.") else "") + f"--{name}={value}",
       f"`{name}` must be {rule}") for name, value, rule in [
        ("eval.batches", HUGE, "in (0, 16384]"), ("train.global_batch_tokens", HUGE, "in (0, 2^30]"),
        ("sample.max_new_tokens", HUGE, "in [0, 2^16]"), ("runtime.threads", HUGE, "in [0, 1024]"),
        ("model.max_seq_len", HUGE, "in [0, 2^22]"), ("train.seq_len", HUGE, "in (0, 2^22]"),
        ("sample.num_samples", HUGE, "in [0, 1024]"), ("sample.temperature", 1e-320, "0 (greedy) or >= 0.0001"),
        ("model.rope_theta", 1e-320, "> 1"), ("model.init_std", 1e308, "in (0, 1]"),
        ("model.logit_softcap", 1e-320, "0 (off) or >= 1"), ("model.norm_eps", 1e308, "in (0, 1]"),
        ("model.vocab_size", HUGE, "in (0, 2^32]"), ("model.dim", HUGE, "in (0, 2^16]"),
        ("optim.muon_ns_steps", HUGE, "in (0, 100]"), ("data.pack_buffer", HUGE, "in (0, 2^20]"),
        ("prepare.shuffle_buffer", HUGE, "in [0, 2^20]"), ("prepare.workers", HUGE, "in [0, 1024]"),
        ("prepare.shard_tokens", HUGE, "in (0, 2^32]"), ("prepare.batch_documents", HUGE, "in (0, 2^20]"),
        ("train.max_steps", HUGE, "below 2^63"), ("checkpoint.keep", HUGE, "below 2^63"),  # the default bound
        ("train.batch_schedule", f"0:4096,3:{2**40}", "in (0, 2^30]"),  # a stage's batch: the batch's bound
        ("profile.ranks", f"0,{HUGE}", "below 2^63")]),  # a list's every number
]
REFUSED = [(args if isinstance(args, list) else args.split(), words or [args.split()[-1][2:].split("=")[0]])
           for args, *words in ROWS]
# Config files (None: a directory at the name; "": no file), given positionally or with --config: the paragraph
# names the file.
YAML = [
    ("broken.yaml", "train:\n  max_steps: [1,\n", [], ""),
    ("invalid.yaml", "train:\n  lr: [1, 2\n", ["not valid YAML", "line"], "--config"),
    ("unknown.yaml", "train:\n  max_stepz: 3\n", [], ""),
    ("key.yaml", "train:\n  learning_rate: 0.1\n", ["learning_rate"], "--config"),
    ("section.yaml", "trainer:\n  max_steps: 3\n", [], ""),
    ("trian.yaml", "trian:\n  lr: 0.1\n", ["trian"], "--config"),
    ("list.yaml", "- 1\n- 2\n", [], ""), ("names.yaml", "- train\n- model\n", ["mapping"], "--config"),
    ("scalar_section.yaml", "train: 5\n", ["train"], "--config"),
    ("a_dir.yaml", None, ["cannot be read"], "--config"),
    ("missing.yaml", "", ["does not exist"], ""), ("nope.yaml", "", ["does not exist"], "--config"),
    ("prompt.yaml", 'sample:\n  prompt: "caf\\udcff"\n', ["`sample.prompt` is 'caf\\udcff', which holds bytes that are "
                                                      "no UTF-8"], ""),  # YAML's lone surrogate
]


def test_at_least_twenty_bad_inputs_are_covered():
    assert len(REFUSED) + len(YAML) >= 20


@pytest.mark.parametrize("args, words", REFUSED, ids=[" ".join(row[0])[:60] for row in REFUSED])
def test_bad_input_exits_2_with_a_paragraph_naming_the_key(args, words, capsys, tmp_path):
    code = run([*(a.format(tmp=tmp_path) for a in args), f"--run.dir={tmp_path}"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("nanopt: error: ") and "Traceback" not in err and err.strip().count("\n") == 0, err
    for word in words:
        assert word.format(tmp=tmp_path) in err, f"{word!r} missing from: {err}"
    assert not any(tmp_path.iterdir()), "a refused config must not write anything"


@pytest.mark.parametrize("name, text, words, via", YAML, ids=[row[0] for row in YAML])
def test_bad_yaml_files_name_the_file(name, text, words, via, tmp_path, capsys):
    path = tmp_path / name
    path.mkdir() if text is None else path.write_text(text) if text else None
    assert run([*([via] if via else []), str(path), f"--run.dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("nanopt: error: ") and "Traceback" not in err and err.strip().count("\n") == 0, err
    for word in [str(path), *words]:
        assert word in err, f"{word!r} missing from: {err}"


@pytest.mark.parametrize("group, world, local, mesh", [
    ("2", 4, 4, (2, 2)), ("1", 2, 2, (2, 1)), ("null", 16, 8, (2, 8)), ("4", 16, 8, (4, 4)),
    ("null", 1, None, None), ("8", 1, None, None),  # one process: nothing sharded or replicated, as under fsdp
    ("3", 4, 4, "`runtime.shard_group_size` is 3, which does not divide the world of 4 ranks: hsdp cuts the ranks "
                "into equal shard groups. Set `--runtime.shard_group_size` to one of 1, 2"),
    ("4", 4, 4, "`runtime.shard_group_size` is 4, the whole world of 4 ranks: one shard group and no replicas, "
                "which is fsdp. Use `--runtime.parallel=fsdp`"),
    ("null", 2, 2, "`runtime.shard_group_size` is null, the ranks per node (2), the whole world of 2 ranks"),
    ("null", 6, 4, "`runtime.shard_group_size` is null, the ranks per node (4), which does not divide the world of 6"),
])
def test_hsdp_tiles_the_world_into_replicas_of_shard_groups_or_refuses_groups_that_do_not(group, world, local, mesh):
    """(replicas, ranks per shard group), or the refusal of a group that does not tile the world or replicates
    nothing; null = the ranks per node (torchrun's LOCAL_WORLD_SIZE). The batch splits over 1, 2, 4, 6, 8 or 16."""
    cfg = load_config(None, parse_overrides(["--runtime.parallel=hsdp", f"--runtime.shard_group_size={group}",
                                             "--train.global_batch_tokens=98304"]))
    if isinstance(mesh, str):
        with pytest.raises(ConfigError) as e:
            resolve(cfg, world, local)
        assert mesh in str(e.value)
    else:
        assert mesh is None or cfg.runtime.hsdp_mesh(world, local) == mesh
        resolve(cfg, world, local)  # accepted


@pytest.mark.parametrize("parallel", ["fsdp", "hsdp"])
def test_fsdp_and_hsdp_accept_compile_init_from_and_task_scoring(parallel, tmp_path):
    """Per-block compilation (train.compile_blocks) is built: issue 38's refusal of train.compile under fsdp is gone.
    train.init_from loads into the shards and eval.tasks / eval.core score on every rank in lockstep under a sharded
    model (tests/test_hf.py, tests/test_tasks.py), so neither is refused."""
    cfg = load_config(None, parse_overrides([f"--runtime.parallel={parallel}", "--train.compile=true"]))
    assert cfg.train.compile and cfg.runtime.parallel == parallel
    cfg = load_config(None, parse_overrides([f"--runtime.parallel={parallel}", f"--train.init_from=hf:{tmp_path}",
                                             "--eval.tasks=hellaswag", f"--eval.core={tmp_path}"]))
    cfg.runtime.check(cfg)


@pytest.mark.parametrize("key, value", [("sample.temperature", 0), ("model.logit_softcap", 0)])
def test_zero_stays_the_off_switch_below_a_bound(key, value):
    load_config(None, parse_overrides([f"--{key}={value}"]))


# ---------------------------------------------------------------- config lists


LISTS = {  # key: (YAML list, the comma form of the command line and of configs before lists, the value)
    "train.batch_schedule": ([[0, 4096], [3, 8192]], "0:4096,3:8192", [[0, 4096], [3, 8192]]),
    "train.seq_len_schedule": (["0:128", "3:256"], "0:128,3:256", [[0, 128], [3, 256]]),
    "eval.tasks": (["hellaswag", "arc_easy"], "hellaswag, arc_easy", ["hellaswag", "arc_easy"]),
    "checkpoint.allow_changes": (["train.lr"], "train.lr", ["train.lr"]),
    "prepare.data_files": (["a.jsonl", "b/*.jsonl"], "a.jsonl,b/*.jsonl", ["a.jsonl", "b/*.jsonl"]),
    "profile.ranks": ([0, 1, 4], "0,1,4", [0, 1, 4]),
}


@pytest.mark.parametrize("name", LISTS)
def test_config_lists_are_yaml_lists_and_the_comma_form_still_loads(name, tmp_path):
    as_list, as_text, value = LISTS[name]
    section, key_name = name.split(".")
    extra = {"profile": {"enabled": True}} if section == "profile" else {}
    forms = []
    for given in (as_list, as_text):
        path = tmp_path / "c.yaml"
        path.write_text(yaml.safe_dump({**extra, section: {**extra.get(section, {}), key_name: given}}))
        forms.append(load_config(path))
    on = ["--profile.enabled=true"] if extra else []
    forms.append(load_config(None, parse_overrides([*on, f"--{name}={as_text}"])))
    assert [getattr(getattr(cfg, section), key_name) for cfg in forms] == [value] * 3
    if name != "profile.ranks":  # refused empty: below
        assert getattr(getattr(load_config(None, parse_overrides([f"--{name}="])), section), key_name) == []
        path.write_text(f"{section}:\n  {key_name}:\n")  # nothing after the key: YAML's null
        assert getattr(getattr(load_config(path), section), key_name) == []
    old = forms[0].to_dict()
    old[section][key_name] = as_text  # a checkpoint's state.json or config.yaml from before lists
    assert config_from_dict(old, "state.json") == forms[0]
    assert resume_changes(old, forms[0]) == [] and resume_changes(old, forms[0], finished=True) == []


def test_profile_ranks_all_is_null():  # and an empty list is refused: REFUSED
    cfg = load_config(None, parse_overrides(["--profile.enabled=true", "--profile.ranks=all"]))
    assert cfg.profile.ranks is None and yaml.safe_load(to_yaml(cfg))["profile"]["ranks"] is None


def test_a_huge_wrong_value_is_shown_shortly_in_its_message(tmp_path):
    """Before, a YAML list of 100,000 numbers where a number goes made a one-line error of 300 KB (1,000: 3 KB)."""
    (tmp_path / "big.yaml").write_text("train:\n  lr: [" + ", ".join(["0"] * 1000) + "]\n")
    with pytest.raises(ConfigError) as e:
        load_config(tmp_path / "big.yaml")
    assert "`train.lr` must be a number, got [0, 0, 0, 0, 0, 0, ...]." in str(e.value) and len(str(e.value)) < 300


# Each key that acts only behind a switch (config.SWITCHES): set with its switch off, then with it on.
SWITCHED = [
    ("--train.ema_start=5", "train.ema_decay", ["--train.ema_decay=0.9"]),
    ("--train.decay_fraction=0.3", "train.schedule", ["--train.schedule=wsd"]),
    ("--train.batch_lr_rule=linear", "train.batch_schedule", ["--train.batch_schedule=0:8192,100:16384"]),
    ("--train.schedule_unit=tokens", "train.batch_schedule", ["--train.seq_len_schedule=0:128,1000:256"]),
    ("--eval.tasks_every=50", "eval.tasks", ["--eval.tasks=hellaswag"]),
    ("--eval.tasks_limit=10", "eval.tasks", ["--eval.tasks=hellaswag"]),
    ("--profile.active=3", "profile.enabled", ["--profile.enabled=true"]),
    ("--profile.ranks=all", "profile.enabled", ["--profile.enabled=true"]),
    ("--runtime.shard_group_size=2", "runtime.parallel", ["--runtime.parallel=hsdp"]),
    ("--model.aspect_ratio=32", "model.depth", ["--model.depth=4"]),
    ("--model.depth_head_dim=32", "model.depth", ["--model.depth=4"]),
    ("--model.mup_base_dim=64", "model.parametrization", ["--model.parametrization=mup"]),
]


@pytest.mark.parametrize("arg, switch, on", SWITCHED, ids=[s[0] for s in SWITCHED])
def test_a_key_set_with_its_switch_off_is_refused_as_ignored_and_accepted_with_it_on(arg, switch, on):
    """One rule for every key behind a switch. Before: train.ema_start without train.ema_decay, decay_fraction
    without wsd and profile.* without profile.enabled were silently ignored, while shard_group_size was refused."""
    name = arg[2:].split("=")[0]
    with pytest.raises(ConfigError) as refused:
        load_config(None, parse_overrides([arg]))
    text = str(refused.value)
    assert f"`{name}` is" in text and f"`{switch}`" in text and "would be ignored" in text, text
    assert f"drop the key (`--{name}=" in text, text
    load_config(None, parse_overrides([arg, *on]))  # the switch on: the key acts
    default = text.split(f"(`--{name}=")[1].split("`")[0]
    load_config(None, parse_overrides([arg, f"--{name}={default}"]))  # the advice followed: the key dropped
