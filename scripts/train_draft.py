"""Train a draft for the configured target by self-distillation (no dataset download).

    .venv/bin/python scripts/train_draft.py generate            # the target's replies
    .venv/bin/python scripts/train_draft.py train --kind K      # fit a draft (resumable)
    .venv/bin/python scripts/train_draft.py eval --out DIR      # held-out acceptance and cost

Data: the target's own replies to configs/prompts/distill_v1.yaml, whose `heldout` prompts are
never trained on. Because greedy replies are the target's argmax, a draft that predicts them is
one whose greedy drafts the target accepts. Two kinds, both with a reduced-vocabulary head over
the target's own (frozen) embeddings:
- compact (llm_engine.compact_draft, `draft` proposer): some of the target's layers, re-trained;
- eagle (llm_engine.eagle_head, `eagle` proposer): one layer over the target's last hidden states.
`--soft` adds the target's whole next-token distribution as a label (from its recorded hidden
states, cached next to the data), which carries more than the one token it chose.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import random
import sys
import time
from collections import Counter
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from llm_engine import compact_draft, eagle_head, kv  # noqa: E402
from llm_engine.config import SamplingConfig, SpeculationConfig  # noqa: E402
from llm_engine.prompts import encode_chat  # noqa: E402
from llm_engine.proposers import ProposeContext, make_proposer  # noqa: E402
from llm_engine.sampling import make_generator  # noqa: E402
from voiceagent.config import load_config  # noqa: E402
from voiceagent.llm_setup import load_llm  # noqa: E402
from voiceagent.logs import progress_bar, write  # noqa: E402

PROMPTS = REPO / "configs" / "prompts" / "distill_v1.yaml"


def prompt_items(path: Path) -> list[dict]:
    """The prompt set as chat conversations, each with an id, category and held-out flag."""
    spec = yaml.safe_load(path.read_text())
    system = [{"role": "system", "content": spec["system"]}] if spec.get("system") else []
    items = []
    for category, entries in spec["categories"].items():
        for n, entry in enumerate(entries):
            entry = {"prompt": entry} if isinstance(entry, str) else entry
            messages = entry.get("messages") or [{"role": "user", "content": entry["prompt"]}]
            items.append({"id": f"{category}/{n}", "category": category,
                          "heldout": bool(entry.get("heldout")), "messages": system + messages})
    return items


def load_target(args):
    cfg = load_config(args.config, args.set)
    return load_llm(cfg.engine.target, cfg.engine, cfg.paths.cache_dir, write)


def read_data(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# --- generate ---------------------------------------------------------------------------------

@torch.inference_mode()
def generate(args) -> None:
    target = load_target(args)
    tok, model = target.tokenizer, target.model
    out = Path(args.data)
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    done = {d["id"] for d in read_data(out)}
    items = prompt_items(Path(args.prompts))
    if args.samples:  # sampled replies: more of the target's distribution than its argmax
        items = [{**it, "id": f"{it['id']}#t{args.temperature:g}s{n}"}
                 for n in range(args.samples) for it in items]
    todo = [it for it in items if it["id"] not in done]
    print(f"{len(done)} replies cached, {len(todo)} to generate", file=sys.stderr)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    gen_eos = model.generation_config.eos_token_id
    eos = {tok.eos_token_id} | set(gen_eos if isinstance(gen_eos, list) else [gen_eos])
    t0, tokens = time.monotonic(), 0
    bar = progress_bar(len(todo), "generate", "prompt")  # on a terminal only
    for start in range(0, len(todo), args.batch):
        batch = todo[start:start + args.batch]
        prompts = [encode_chat(tok, it["messages"]) for it in batch]
        width = max(map(len, prompts))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])  # [b, width] left-pad
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        sampling = ({"do_sample": True, "temperature": args.temperature, "top_k": 0}
                    if args.samples else {"do_sample": False})
        gen = model.generate(ids.to(model.device), attention_mask=mask.to(model.device),
                             max_new_tokens=args.max_new_tokens, pad_token_id=pad,
                             **sampling)[:, width:].tolist()  # [b, new]
        with out.open("a") as f:
            for it, p, reply in zip(batch, prompts, gen, strict=True):
                cut = next((i + 1 for i, t in enumerate(reply) if t in eos), len(reply))
                reply = reply[:cut]
                tokens += len(reply)
                f.write(json.dumps({"id": it["id"], "category": it["category"],
                                    "heldout": it["heldout"], "prompt_ids": p,
                                    "reply_ids": reply}) + "\n")
        rate = tokens / (time.monotonic() - t0)
        write(f"  {start + len(batch)}/{len(todo)} prompts, {tokens} reply tokens, "
              f"{rate:.0f} tok/s")
        bar.update(len(batch))
    bar.close()


# --- target features -------------------------------------------------------------------------

@torch.inference_mode()
def target_features(target, data: list[dict], path: Path) -> dict[str, torch.Tensor]:
    """The target's last hidden states [len(seq), hidden] (fp16) of every sequence, by id: what an
    EAGLE head reads, and through the target's head, its full next-token distributions (soft
    labels). Cached in `path`, tied to the target's weights."""
    cached = torch.load(path, weights_only=False) if path.exists() else {}
    if cached.get("target_file_sha256") != target.file_sha256:
        cached = {"target_file_sha256": target.file_sha256, "features": {}}
    feats = cached["features"]
    todo = sorted((d for d in data if d["id"] not in feats),
                  key=lambda d: len(d["prompt_ids"]) + len(d["reply_ids"]))
    t0 = time.monotonic()
    bar = progress_bar(len(todo), "target features", "seq")
    for start in range(0, len(todo), 8):
        rows = todo[start:start + 8]
        ids, mask = padded([r["prompt_ids"] + r["reply_ids"] for r in rows])
        hidden = target.model(input_ids=ids, attention_mask=mask,
                              output_hidden_states=True).hidden_states[-1]  # [b, width, hidden]
        for i, r in enumerate(rows):
            feats[r["id"]] = hidden[i, :int(mask[i].sum())].half().clone()
        if (start // 8) % 25 == 0 or start + 8 >= len(todo):
            write(f"  features: {min(start + 8, len(todo))}/{len(todo)} sequences, "
                  f"{time.monotonic() - t0:.0f} s")
        bar.update(len(rows))
    bar.close()
    if todo:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(cached, path)
    return feats


def padded(seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids and attention mask [b, width]."""
    width = max(map(len, seqs))
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s)
        mask[i, :len(s)] = 1
    return ids, mask


# --- train ------------------------------------------------------------------------------------

def choose_vocab(train: list[dict], size: int, always: set[int]) -> torch.Tensor:
    counts = Counter(t for d in train for t in d["reply_ids"])
    ids = [t for t, _ in counts.most_common(size - len(always)) if t not in always]
    ids = sorted(set(ids) | always)
    covered = sum(counts[t] for t in ids) / max(1, sum(counts.values()))
    print(f"draft vocabulary: {len(ids)} ids cover {covered:.1%} of training reply tokens",
          file=sys.stderr)
    return torch.tensor(ids)


class Batch:
    """A right-padded batch. Row i of every [b, t] tensor is the position that predicts token i + 1
    (compact) or whose successor feature and token i + 2 the EAGLE head predicts; `weight` marks
    the positions whose prediction lands in a reply."""

    def __init__(self, rows: list[dict], feats: dict | None, shift: int):
        seqs = [r["prompt_ids"] + r["reply_ids"] for r in rows]
        self.ids, self.mask = padded(seqs)  # [b, w]
        b, w = self.ids.shape
        self.weight = torch.zeros(b, w)
        self.labels = torch.full((b, w), -1, dtype=torch.long)  # full-vocabulary ids, -1: none
        for i, (r, s) in enumerate(zip(rows, seqs, strict=True)):
            first = max(len(r["prompt_ids"]) - 1 - shift, 0)  # predicts the first reply token
            self.weight[i, first:len(s) - 1 - shift] = 1
            self.labels[i, first:len(s) - 1 - shift] = torch.tensor(s[first + 1 + shift:])
        if feats is not None:
            self.feats = torch.zeros(b, w, feats[rows[0]["id"]].shape[-1])  # [b, w, hidden]
            for i, r in enumerate(rows):
                f = feats[r["id"]].float()
                self.feats[i, :len(f)] = f


def batches(data: list[dict], batch: int, rng: random.Random, feats, shift: int):
    order = list(range(len(data)))
    while True:
        rng.shuffle(order)
        for start in range(0, len(order) - batch + 1, batch):
            yield Batch([data[i] for i in order[start:start + batch]], feats, shift)


def distill_loss(logits_small: torch.Tensor, batch: Batch, teacher: torch.Tensor | None,
                 to_small: torch.Tensor, args) -> torch.Tensor:
    """Cross-entropy to the reply tokens and, with --soft, to the target's whole distribution
    over the draft vocabulary (teacher: its logits there, [b, t, v])."""
    w = batch.weight
    labels = torch.where(batch.labels >= 0, to_small[batch.labels.clamp(min=0)], -100)
    loss = args.hard * torch.nn.functional.cross_entropy(
        logits_small.flatten(0, 1), labels.flatten())
    if args.soft and teacher is not None:
        log_q = torch.log_softmax(logits_small, -1)
        soft = -(torch.softmax(teacher, -1) * log_q).sum(-1)  # [b, t]
        loss = loss + args.soft * (soft * w).sum() / w.sum()
    return loss


def compact_step(draft, batch: Batch, head_rows, to_small, args) -> torch.Tensor:
    hidden = draft.model(input_ids=batch.ids, attention_mask=batch.mask).last_hidden_state
    teacher = batch.feats @ head_rows.T if args.soft else None  # [b, t, v]
    return distill_loss(draft.lm_head.small_logits(hidden), batch, teacher, to_small, args)


def eagle_step(head, batch: Batch, head_rows, to_small, args) -> torch.Tensor:
    """EAGLE's loss: position i reads (f_i, t_{i+1}) and predicts f_{i+1} (smooth L1) and, through
    the head, token t_{i+2}. With --tt, a second pass reads the head's own predicted features
    instead of the target's, as every draft position after the first does when serving."""
    tokens, target_feats, mask = batch.ids[:, 1:], batch.feats[:, 1:], batch.mask[:, 1:]
    w = batch.weight[:, :-1]
    sub = copy.copy(batch)
    sub.weight, sub.labels = w, batch.labels[:, :-1]
    teacher = target_feats @ head_rows.T if args.soft else None  # [b, t - 1, v]
    feats, loss = batch.feats[:, :-1], 0.0
    for _ in range(2 if args.tt else 1):
        predicted = head(feats, tokens, attention_mask=mask)  # [b, t - 1, hidden]
        reg = torch.nn.functional.smooth_l1_loss(predicted, target_feats, reduction="none")
        loss = loss + (reg.mean(-1) * w).sum() / w.sum() + distill_loss(
            head.head.small_logits(predicted), sub, teacher, to_small, args)
        feats = torch.cat([batch.feats[:, :1], predicted[:, :-1]], 1)  # f_0, then predictions
    return loss


def train(args) -> None:
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    target = load_target(args)
    data = read_data(Path(args.data))
    train_set = [d for d in data if not d["heldout"]]
    if not train_set:
        raise SystemExit(f"no training data in {args.data}: run `generate` first")
    out = Path(args.out)
    ckpt = out / "train_state.pt"
    always = {target.tokenizer.eos_token_id}
    vocab = choose_vocab(train_set, args.vocab, always)
    eagle = args.kind == "eagle"
    feats = (target_features(target, train_set, Path(args.data).with_name("features.pt"))
             if eagle or args.soft else None)
    if eagle:
        model = eagle_head.build_from_target(target.model, vocab)
        own, step_fn, shift = (lambda m: m.state_dict()), eagle_step, 1
    else:
        layers = [int(x) for x in args.layers.split(",")]
        model = compact_draft.build_from_target(target.model, layers, vocab)
        model.model.embed_tokens.requires_grad_(False)
        own, step_fn, shift = compact_draft.own_parameters, compact_step, 0
    head_rows = target.model.get_output_embeddings().weight.detach()[vocab]  # [v, hidden]
    to_small = torch.full((target.model.config.vocab_size,), -100, dtype=torch.long)
    to_small[vocab] = torch.arange(len(vocab))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    step = 0
    if args.resume and ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        model.load_state_dict(state["model"], strict=False)
        opt.load_state_dict(state["opt"])
        step, rng = state["step"], state["rng"]
        torch.set_rng_state(state["torch_rng"])
        print(f"resumed at step {step}", file=sys.stderr)
    model.train()
    stream = batches(train_set, args.batch, rng, feats, shift)
    t0 = time.monotonic()
    bar = progress_bar(args.steps, "train", "step", initial=step)
    while step < args.steps:
        batch = next(stream)
        lr = args.lr * min(1.0, (step + 1) / 20) * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        for g in opt.param_groups:
            g["lr"] = lr
        loss = step_fn(model, batch, head_rows, to_small, args)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        bar.update()
        if step % 10 == 0 or step == args.steps:
            write(f"  step {step}/{args.steps} loss {loss.item():.3f} lr {lr:.2e} "
                  f"{time.monotonic() - t0:.0f} s")
        if step % args.save_every == 0 or step == args.steps:
            out.mkdir(parents=True, exist_ok=True)
            torch.save({"model": own(model), "opt": opt.state_dict(), "step": step, "rng": rng,
                        "torch_rng": torch.get_rng_state()}, ckpt)
    bar.close()
    meta = {"kind": args.kind, "target": target.name, "target_file_sha256": target.file_sha256,
            "vocab_size": len(vocab), "steps": step, "batch": args.batch, "lr": args.lr,
            "hard": args.hard, "soft": args.soft, "tt": args.tt, "seed": args.seed,
            "prompts": Path(args.prompts).name, "train_replies": len(train_set),
            "train_seconds": round(time.monotonic() - t0)}
    if eagle:
        eagle_head.save(model.eval(), out, meta)
    else:
        compact_draft.save(model.eval(), out, {**meta, "layers": layers})
    print(f"saved {out}", file=sys.stderr)


# --- eval -------------------------------------------------------------------------------------

@torch.inference_mode()
def evaluate(args) -> None:
    """Held-out acceptance through the serving proposers themselves, the target simulated by its
    recorded greedy replies (and, for EAGLE, its recorded features)."""
    target = load_target(args)
    out = Path(args.out)
    eagle = eagle_head.is_eagle_head(out)
    model = (eagle_head.load(out, target.model) if eagle
             else compact_draft.load(out, target.model))
    meta = eagle_head.read_meta(out) if eagle else compact_draft.read_meta(out)
    # Greedy held-out replies only: what the target itself would say, token for token.
    held = [d for d in read_data(Path(args.data)) if d["heldout"] and "#" not in d["id"]]
    feats = (target_features(target, held, Path(args.data).with_name("features.pt"))
             if eagle else None)
    make = lambda: make_proposer("eagle" if eagle else "draft", SpeculationConfig(), model)  # noqa: E731
    k, greedy = args.k, SamplingConfig()
    steps = tokens = 0
    accepted, drafted = [0] * k, [0] * k
    for d in progress_bar(desc="eval", unit="reply", iterable=held):
        seq, p = d["prompt_ids"] + d["reply_ids"], len(d["prompt_ids"])
        proposer = make()
        proposer.begin(seq[:p])
        n = p + 1  # the prefill committed the first reply token
        if eagle:
            proposer.observe_target(seq[:n], feats[d["id"]][:p].float())
        while n < len(seq):
            draft = proposer.propose(ProposeContext(seq[:n], k, greedy, make_generator(0)))
            truth = seq[n:n + k]
            a = 0
            while a < min(len(truth), len(draft.tokens)) and draft.tokens[a] == truth[a]:
                a += 1
            for i in range(min(a + 1, len(truth))):
                drafted[i] += 1
                accepted[i] += i < a
            steps += 1
            committed = min(a + 1, len(seq) - n)
            tokens += committed
            if eagle:
                proposer.observe_target(seq[:n + committed],
                                        feats[d["id"]][n - 1:n + committed - 1].float())
            else:
                proposer.update(a)
            n += committed
        proposer.release()
    report = {
        "heldout_replies": len(held),
        "heldout_tokens": sum(len(d["reply_ids"]) for d in held),
        "k": k, "tokens_per_target_forward": tokens / steps,
        "acceptance_by_position": [a / max(1, n) for a, n in zip(accepted, drafted, strict=True)],
        "draft_cost_per_token_vs_target": relative_cost(make, target.model, k),
    }
    print(json.dumps(report, indent=1))
    (out / "eval.json").write_text(json.dumps(report, indent=1))
    write_card(out, meta, report)


def write_card(folder: Path, meta: dict, report: dict) -> None:
    """The model card: what the draft is, what it was trained on, and how well it drafts."""
    acc = ", ".join(f"{a:.2f}" for a in report["acceptance_by_position"])
    if meta.get("kind") == "eagle":
        title, what = "EAGLE head", (
            "one decoder layer (initialised from the target's last) that reads the target's last "
            "hidden state and the next token's embedding and predicts the next hidden state "
            "(Li et al. 2024); served by the `eagle` proposer")
    else:
        layers = ", ".join(map(str, meta["layers"]))
        title, what = "Compact draft", (
            f"the target's layers {layers} (re-trained) and its final norm; served by the "
            "`draft` proposer")
    labels = " and ".join(
        ["the target's next hidden state (smooth L1)"] * (meta.get("kind") == "eagle")
        + [f"the reply tokens (weight {meta.get('hard', 1.0)})"] * bool(meta.get("hard", 1.0))
        + [f"the target's full next-token distribution (weight {meta['soft']})"]
        * bool(meta.get("soft"))
        + ["a second pass on its own predicted features"] * bool(meta.get("tt")))
    (folder / "README.md").write_text(f"""# {title} for {meta['target']}

Trained by self-distillation with `scripts/train_draft.py` (this repository); see the README's
engine section for the command lines and the alternatives measured.

- Target: `{meta['target']}`, weights sha256 `{meta['target_file_sha256']}`. It runs over the
  target's own input embeddings and is refused for any other target.
- Architecture: {what}. Output head over the {meta['vocab_size']} most frequent reply tokens
  (fp16 safetensors); other tokens are never drafted, and the target verifies over its full
  vocabulary, so output is unchanged.
- Data: the target's own replies to `configs/prompts/{meta['prompts']}` ({meta['train_replies']}
  training replies: greedy and sampled); the prompts marked `heldout` were never trained on.
- Training: {meta['steps']} steps of {meta['batch']} sequences, AdamW lr {meta['lr']} (cosine),
  seed {meta['seed']}; losses: {labels}; {meta['train_seconds']} s on a 2-core CPU.
- Held-out greedy replies ({report['heldout_replies']} replies, {report['heldout_tokens']} tokens),
  drafted through the serving proposer with K = {report['k']}:
  {report['tokens_per_target_forward']:.2f} tokens per target forward; acceptance by draft
  position (given the earlier ones accepted): {acc}.
- Cost: drafting one token takes {report['draft_cost_per_token_vs_target']:.3f} of a target
  decode step on this CPU.
- Licence: derived from SmolLM2-135M-Instruct (Apache-2.0).
""")


@torch.inference_mode()
def relative_cost(make, target, k: int, n: int = 30) -> float:
    """Median time per drafted token of a k-token proposal over a target decode step, both on a
    64-token context."""
    context = list(range(100, 164))
    proposer = make()
    proposer.begin(context)
    if getattr(proposer, "uses_target_hidden", False):
        hidden = kv.forward(target, torch.tensor([context]), kv.new_cache(target), hidden=True)[1]
        proposer.observe_target(context, hidden[:-1])
    ctx = ProposeContext(context, k, SamplingConfig(), make_generator(0))
    drafts = []
    for i in range(n + 1):
        proposer.begin(context[:-1])  # one unseen position, as after a verification
        t = time.perf_counter()
        proposer.propose(ctx)
        if i:  # the first proposal also ran the whole context through the draft
            drafts.append((time.perf_counter() - t) / k)
    cache, plain = kv.new_cache(target), []
    kv.forward(target, torch.tensor([context]), cache)
    for i in range(n):
        t = time.perf_counter()
        kv.forward(target, torch.tensor([[200 + i]]), cache, last_only=True).argmax().item()
        plain.append(time.perf_counter() - t)
    return sorted(drafts)[n // 2] / sorted(plain)[n // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("phase", choices=["generate", "train", "eval"])
    ap.add_argument("--config", help="voiceagent config (its engine.target is the target)")
    ap.add_argument("--set", action="append", default=[], help="config override key=value")
    ap.add_argument("--prompts", default=str(PROMPTS))
    ap.add_argument("--data", default="runs/distill_v1/replies.jsonl")
    ap.add_argument("--out", default="drafts/smollm2-135m-draft")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--samples", type=int, default=0,
                    help="generate: this many sampled replies per prompt instead of the greedy one")
    ap.add_argument("--temperature", type=float, default=0.8, help="generate: for --samples")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--kind", choices=["compact", "eagle"], default="compact",
                    help="train: a compact draft (`draft` proposer) or an EAGLE head (`eagle`)")
    ap.add_argument("--layers", default="0,1", help="compact: target layers the draft starts from")
    ap.add_argument("--vocab", type=int, default=4096, help="draft output vocabulary size")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--hard", type=float, default=1.0, help="weight of the reply-token loss")
    ap.add_argument("--soft", type=float, default=0.0,
                    help="weight of the loss to the target's full next-token distribution")
    ap.add_argument("--tt", action="store_true",
                    help="eagle: also train on its own predicted features (training-time test)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save-every", type=int, default=50)
    ap.add_argument("--resume", action="store_true", help="continue from out/train_state.pt")
    ap.add_argument("--k", type=int, default=4, help="eval: draft length")
    args = ap.parse_args()
    {"generate": generate, "train": train, "eval": evaluate}[args.phase](args)


if __name__ == "__main__":
    main()
