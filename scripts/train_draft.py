"""Train a compact draft for the configured target by self-distillation (no dataset download).

    .venv/bin/python scripts/train_draft.py generate   # the target's greedy replies
    .venv/bin/python scripts/train_draft.py train      # fit the draft to them (resumable)
    .venv/bin/python scripts/train_draft.py eval       # held-out acceptance and cost

Data: the target's own greedy replies to configs/prompts/distill_v1.yaml, whose `heldout` prompts
are never trained on. Because the replies are the target's argmax, a draft that predicts them is
one whose greedy drafts the target accepts. The draft (llm_engine.compact_draft) starts from the
target's layers, final norm and head rows, over the target's own (frozen) embeddings.
"""

from __future__ import annotations

import argparse
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

from llm_engine import compact_draft, kv  # noqa: E402
from llm_engine.prompts import encode_chat  # noqa: E402
from voiceagent.config import load_config  # noqa: E402
from voiceagent.llm_setup import load_llm  # noqa: E402

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
    say = lambda msg: print(msg, file=sys.stderr)  # noqa: E731
    return load_llm(cfg.engine.target, cfg.engine, cfg.paths.cache_dir, say)


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
        print(f"  {start + len(batch)}/{len(todo)} prompts, {tokens} reply tokens, "
              f"{rate:.0f} tok/s", file=sys.stderr)


# --- train ------------------------------------------------------------------------------------

def choose_vocab(train: list[dict], size: int, always: set[int]) -> torch.Tensor:
    counts = Counter(t for d in train for t in d["reply_ids"])
    ids = [t for t, _ in counts.most_common(size - len(always)) if t not in always]
    ids = sorted(set(ids) | always)
    covered = sum(counts[t] for t in ids) / max(1, sum(counts.values()))
    print(f"draft vocabulary: {len(ids)} ids cover {covered:.1%} of training reply tokens",
          file=sys.stderr)
    return torch.tensor(ids)


def batches(data: list[dict], batch: int, rng: random.Random, to_small: torch.Tensor):
    """Right-padded (input, label) batches; labels are small-vocab indices on reply positions."""
    order = list(range(len(data)))
    while True:
        rng.shuffle(order)
        for start in range(0, len(order) - batch + 1, batch):
            rows = [data[i] for i in order[start:start + batch]]
            seqs = [r["prompt_ids"] + r["reply_ids"] for r in rows]
            width = max(map(len, seqs))
            ids = torch.zeros(len(rows), width, dtype=torch.long)
            labels = torch.full((len(rows), width), -100, dtype=torch.long)
            mask = torch.zeros(len(rows), width, dtype=torch.long)
            for i, (r, s) in enumerate(zip(rows, seqs, strict=True)):
                ids[i, :len(s)] = torch.tensor(s)
                mask[i, :len(s)] = 1
                p = len(r["prompt_ids"])
                labels[i, p - 1:len(s) - 1] = to_small[torch.tensor(r["reply_ids"])]
            yield ids, mask, labels


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
    layers = [int(x) for x in args.layers.split(",")]
    always = {target.tokenizer.eos_token_id}
    vocab = choose_vocab(train_set, args.vocab, always)
    draft = compact_draft.build_from_target(target.model, layers, vocab)
    to_small = torch.full((draft.config.vocab_size,), -100, dtype=torch.long)
    to_small[vocab] = torch.arange(len(vocab))
    draft.model.embed_tokens.requires_grad_(False)
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    step = 0
    if args.resume and ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        draft.load_state_dict(state["draft"], strict=False)
        opt.load_state_dict(state["opt"])
        step, rng = state["step"], state["rng"]
        torch.set_rng_state(state["torch_rng"])
        print(f"resumed at step {step}", file=sys.stderr)
    draft.train()
    stream = batches(train_set, args.batch, rng, to_small)
    t0 = time.monotonic()
    while step < args.steps:
        ids, mask, labels = next(stream)
        lr = args.lr * min(1.0, (step + 1) / 20) * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        for g in opt.param_groups:
            g["lr"] = lr
        hidden = draft.model(input_ids=ids, attention_mask=mask).last_hidden_state
        logits = draft.lm_head.small_logits(hidden)  # [b, t, v]
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        if step % 10 == 0 or step == args.steps:
            print(f"  step {step}/{args.steps} loss {loss.item():.3f} lr {lr:.2e} "
                  f"{time.monotonic() - t0:.0f} s", file=sys.stderr)
        if step % args.save_every == 0 or step == args.steps:
            out.mkdir(parents=True, exist_ok=True)
            torch.save({"draft": compact_draft.own_parameters(draft), "opt": opt.state_dict(),
                        "step": step, "rng": rng, "torch_rng": torch.get_rng_state()}, ckpt)
    meta = {"target": target.name, "target_file_sha256": target.file_sha256, "layers": layers,
            "vocab_size": len(vocab), "steps": step, "batch": args.batch, "lr": args.lr,
            "seed": args.seed, "prompts": Path(args.prompts).name,
            "train_replies": len(train_set), "train_seconds": round(time.monotonic() - t0)}
    compact_draft.save(draft.eval(), out, meta)
    print(f"saved {out}", file=sys.stderr)


# --- eval -------------------------------------------------------------------------------------

@torch.inference_mode()
def accepted_run(draft, cache, prefix: list[int], truth: list[int], k: int) -> int:
    """Greedy-draft k tokens after `prefix` (cache holds prefix[:-1]); count the leading ones
    equal to `truth`. The cache is left holding prefix[:-1] again."""
    start = kv.cache_length(cache)
    nxt = torch.tensor([prefix[start:]])
    n = 0
    for i in range(min(k, len(truth))):
        token = kv.forward(draft, nxt, cache, last_only=True).argmax(-1)  # [1]
        if token.item() != truth[i]:
            break
        n += 1
        nxt = token.view(1, 1)
    kv.crop_to(cache, start)
    return n


@torch.inference_mode()
def evaluate(args) -> None:
    target = load_target(args)
    draft = compact_draft.load(args.out, target.model)
    # Greedy held-out replies only: what the target itself would say, token for token.
    held = [d for d in read_data(Path(args.data)) if d["heldout"] and "#" not in d["id"]]
    k = args.k
    steps = tokens = agree = positions = 0
    by_pos = [0] * k
    drafted_pos = [0] * k
    for d in held:
        cache = kv.new_cache(draft)
        seq = d["prompt_ids"] + d["reply_ids"]
        p = len(d["prompt_ids"])
        kv.forward(draft, torch.tensor([seq[:p - 1]]), cache)  # cache: prompt minus last token
        pos = p
        while pos < len(seq):
            n = accepted_run(draft, cache, seq[:pos], seq[pos:], k)
            for i in range(min(k, len(seq) - pos)):
                drafted_pos[i] += i <= n
                by_pos[i] += i < n
            steps += 1
            tokens += min(n + 1, len(seq) - pos)
            kv.forward(draft, torch.tensor([seq[kv.cache_length(cache):pos + n]]), cache)
            pos += n + 1
        logits = draft(torch.tensor([seq])).logits[0, p - 1:-1]  # [reply, vocab]
        agree += (logits.argmax(-1) == torch.tensor(d["reply_ids"])).sum().item()
        positions += len(d["reply_ids"])
    cost = relative_cost(draft, target.model)
    report = {
        "heldout_replies": len(held), "heldout_tokens": positions,
        "top1_agreement": agree / positions, "k": k,
        "tokens_per_target_forward": tokens / steps,
        "acceptance_by_position": [a / max(1, n) for a, n in zip(by_pos, drafted_pos, strict=True)],
        "draft_cost_per_token_vs_target": cost,
    }
    print(json.dumps(report, indent=1))
    (Path(args.out) / "eval.json").write_text(json.dumps(report, indent=1))
    write_card(Path(args.out), compact_draft.read_meta(args.out), report)


def write_card(folder: Path, meta: dict, report: dict) -> None:
    """The model card: what the draft is, what it was trained on, and how well it drafts."""
    acc = ", ".join(f"{a:.2f}" for a in report["acceptance_by_position"])
    layers = ", ".join(map(str, meta["layers"]))
    (folder / "README.md").write_text(f"""# Compact draft for {meta['target']}

Trained by self-distillation with `scripts/train_draft.py` (this repository); see the README's
engine section for the command lines and the alternatives measured.

- Target: `{meta['target']}`, weights sha256 `{meta['target_file_sha256']}`. The draft runs over
  the target's own input embeddings and is refused for any other target.
- Architecture: the target's layers {layers} (re-trained), its final norm, and an output head over
  the {meta['vocab_size']} most frequent reply tokens (fp16 safetensors); the other tokens are
  never drafted, the target verifies over its full vocabulary, so output is unchanged.
- Data: the target's own replies to `configs/prompts/{meta['prompts']}` ({meta['train_replies']}
  training replies: greedy and sampled); the prompts marked `heldout` were never trained on.
- Training: {meta['steps']} steps of {meta['batch']} sequences, AdamW lr {meta['lr']} (cosine),
  seed {meta['seed']}, {meta['train_seconds']} s on a 2-core CPU.
- Held-out greedy replies ({report['heldout_replies']} replies, {report['heldout_tokens']}
  tokens): top-1 agreement with the target {report['top1_agreement']:.3f}; with K =
  {report['k']} drafted tokens per step, {report['tokens_per_target_forward']:.2f} tokens per
  target forward; acceptance by draft position (given the earlier ones accepted): {acc}.
- Cost: one draft decode step takes {report['draft_cost_per_token_vs_target']:.3f} of a target
  decode step on this CPU.
- Licence: derived from SmolLM2-135M-Instruct (Apache-2.0).
""")


@torch.inference_mode()
def relative_cost(draft, target, n: int = 40) -> float:
    """Median single-token decode step time of the draft over the target's, same context."""
    def step_ms(model) -> float:
        cache = kv.new_cache(model)
        kv.forward(model, torch.arange(100, 164).view(1, -1), cache)
        times = []
        for i in range(n):
            t = time.perf_counter()
            kv.forward(model, torch.tensor([[200 + i]]), cache, last_only=True)
            times.append(time.perf_counter() - t)
        return sorted(times)[n // 2]
    return step_ms(draft) / step_ms(target)


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
    ap.add_argument("--layers", default="0,1", help="target layers the draft starts from")
    ap.add_argument("--vocab", type=int, default=4096, help="draft output vocabulary size")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save-every", type=int, default=50)
    ap.add_argument("--resume", action="store_true", help="continue from out/train_state.pt")
    ap.add_argument("--k", type=int, default=4, help="eval: draft length")
    args = ap.parse_args()
    {"generate": generate, "train": train, "eval": evaluate}[args.phase](args)


if __name__ == "__main__":
    main()
