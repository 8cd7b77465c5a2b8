"""The proposer interface and the registry of implementations by name.

A proposer guesses the next k tokens; the target verifies them (see `llm_engine.verify`). Each
request owns its proposer, so proposer state (a draft KV cache, an n-gram index) is per request.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from llm_engine import methods
from llm_engine.config import SamplingConfig, SpeculationConfig
from llm_engine.sampling import is_greedy, logits_to_probs, penalize, sample, uses_history
from llm_engine.verify import mask_logits

if TYPE_CHECKING:
    from llm_engine.grammar import GrammarState


@dataclass
class Draft:
    tokens: list[int]  # [k] drafted token ids, k may be shorter than asked (0: nothing to propose)
    q: torch.Tensor | None = None  # [k, vocab] draft probabilities; None for deterministic drafts
    forced: int = 0  # leading tokens the grammar forced (`proposers.grammar`), for the stats

    def head(self, n: int) -> Draft:
        """The first n tokens (a constrained request cuts a draft where its grammar refuses)."""
        if n >= len(self.tokens):
            return self
        return Draft(self.tokens[:n], None if self.q is None else self.q[:n], min(self.forced, n))


EMPTY_DRAFT = Draft([])


class DraftBuilder:
    """A model-drafted proposal, one position at a time: the argmax when greedy, else a sample
    whose distribution (a row of q) is kept for verification.

    Under a grammar each position's logits get the mask the target's will get, and the token is
    pushed onto the grammar's frontier (a host sync per token, for constrained requests only).
    With history penalties, position i is penalised with `history` and the i drafts before it,
    as the target's verify row i is (`sampling.penalize`; a host sync per token for those too).
    """

    def __init__(self, sampling: SamplingConfig, generator: torch.Generator,
                 grammar: GrammarState | None = None, history: list[int] | None = None,
                 exempt: Collection[int] = ()):
        self.sampling, self.generator, self.grammar = sampling, generator, grammar
        self.greedy = is_greedy(sampling)
        # The committed tokens, then each drafted one: what the next position is penalised with.
        self._history = list(history or []) if uses_history(sampling) else None
        self._exempt = exempt
        self._tokens: list[torch.Tensor] = []
        self._q: list[torch.Tensor] = []
        self._allowed: int | None = None  # under a grammar: drafts it accepted, a prefix

    def choose(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [1, vocab] -> the drafted token [1], left on the device."""
        if self.grammar is not None:
            logits = mask_logits(logits, self.grammar.allowed().to(logits.device))
        if self._history is not None:
            logits = penalize(logits, self._history, (), self.sampling, self._exempt)
        token = self._choose(logits)
        self._tokens.append(token)
        if self._history is not None:
            self._history.append(int(token))
        if self.grammar is not None and self._allowed is None:
            # Refused only after EOS (the masked choice is allowed otherwise): the draft ends.
            if not self.grammar.push(int(token)):
                self._allowed = len(self._tokens) - 1
        return token

    def _choose(self, logits: torch.Tensor) -> torch.Tensor:
        if self.greedy:
            token = logits.argmax(dim=-1)
        else:
            q_row = logits_to_probs(logits, self.sampling)  # [1, vocab]
            token = sample(q_row, self.generator)
            self._q.append(q_row)
        return token

    def build(self) -> Draft:
        tokens = torch.cat(self._tokens).tolist()  # [k], the proposal's one host sync
        draft = Draft(tokens, torch.cat(self._q) if self._q else None)  # q: [k, vocab]
        return draft if self._allowed is None else draft.head(self._allowed)


@dataclass
class ProposeContext:
    token_ids: list[int]  # every committed token of the request, prompt first; read-only
    k: int  # how many tokens to draft at most
    sampling: SamplingConfig  # the same transform the target uses
    generator: torch.Generator  # the request's generator, so seeded runs reproduce
    # A constrained request's grammar at its committed tokens: drafts must be masked by it.
    grammar: GrammarState | None = None
    penalty_exempt: Collection[int] = ()  # tokens the history penalties spare (the target's EOS)

    def draft_builder(self) -> DraftBuilder:
        """A builder that shapes each drafted position as the target's verify row is shaped."""
        return DraftBuilder(self.sampling, self.generator, self.grammar, self.token_ids,
                            self.penalty_exempt)


class Proposer:
    """The interface, with the defaults of a stateless proposer; `@register` a subclass."""

    # What its method's entry in `llm_engine.methods` says (a test keeps them equal); the engine
    # reads them on the instance, where a combining proposer answers for the one it wraps.
    model_setting: ClassVar[str | None] = None
    samples_drafts: ClassVar[bool] = False
    uses_target_hidden: ClassVar[bool] = False
    combines: ClassVar[bool] = False

    @classmethod
    def create(cls, spec: SpeculationConfig, model: torch.nn.Module | None = None) -> Proposer:
        """Build one for a request; `model` is the one named by `model_setting`."""
        return cls()

    @classmethod
    def around(cls, inner: Proposer) -> Proposer:
        """Only where `combines`: one that drafts with `inner` where it has nothing itself
        (method "<this>+<inner>")."""
        raise NotImplementedError

    def begin(self, prompt_ids: list[int]) -> None:
        """Start a request. State whose tokens are a prefix of the prompt may be kept."""

    def propose(self, ctx: ProposeContext) -> Draft:
        """Draft up to ctx.k tokens following ctx.token_ids."""
        raise NotImplementedError

    def observe_target(self, token_ids: list[int], hidden: torch.Tensor) -> None:
        """Only when uses_target_hidden: the committed tokens after a target forward, and that
        forward's hidden states [r, hidden] for the r committed positions it ran (which end just
        before the last token)."""

    def update(self, num_accepted: int) -> None:
        """After verification of the last draft: roll back whatever was built on rejected tokens."""

    def release(self) -> None:
        """Free the proposer's memory (a draft KV cache)."""


_REGISTRY: dict[str, type[Proposer]] = {}


def register(name: str) -> Callable[[type[Proposer]], type[Proposer]]:
    """Class decorator: the proposer class of method `name` (`llm_engine.methods`), built by name
    through its `create`."""

    def wrap(cls: type[Proposer]) -> type[Proposer]:
        if name not in methods.METHODS:
            raise ValueError(f"proposer {cls.__name__}: {name!r} is not in llm_engine.methods")
        _REGISTRY[name] = cls
        return cls

    return wrap


def registered() -> dict[str, type[Proposer]]:
    return dict(_REGISTRY)


def make_proposer(
    name: str, spec: SpeculationConfig, model: torch.nn.Module | None = None
) -> Proposer:
    methods.check(name)
    outer, _, inner = name.partition("+")
    if inner:
        return _REGISTRY[outer].around(make_proposer(inner, spec, model))
    return _REGISTRY[name].create(spec, model)
