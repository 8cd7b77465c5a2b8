"""Typed configuration of the engine, one dataclass per concern.

These are plain dataclasses so that `llm_engine` stays free of application dependencies.
`__pydantic_config__` lets the application's YAML loader validate them strictly (unknown keys
are refused) without this package importing pydantic.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from llm_engine import methods

STRICT = {"extra": "forbid", "validate_assignment": True}


@dataclass
class GrammarSpec:
    """What a constrained request's output must match (`llm_engine.grammar` compiles it).

    kind "json_schema": the whole output is one JSON value under `json_schema`.
    kind "tools": free text, or one call written as
    `<tool_call>{"name": "<a tool's name>", "arguments": {...}}</tool_call>` whose arguments
    follow that tool's parameters; `tools` are OpenAI-style function schemas,
    `{"type": "function", "function": {"name": ..., "parameters": {...}}}` (or the inner dict).
    tool_choice "required": no free text, the output is one call. "none": free text that never
    starts a call (the tools are in the prompt, but the reply must answer in words), nor holds
    any of `exclude` (a voice reply excludes markup, which a small model copies from the calls).
    """

    __pydantic_config__ = STRICT

    kind: Literal["json_schema", "tools"]
    json_schema: dict | None = None
    tools: list[dict] = field(default_factory=list)
    tool_choice: Literal["auto", "required", "none"] = "auto"
    exclude: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.kind == "json_schema" and self.json_schema is None:
            raise ValueError("a json_schema grammar needs json_schema")
        if self.kind == "tools":
            if not self.tools:
                raise ValueError("a tools grammar needs at least one tool")
            for tool in self.tools:
                if not isinstance(tool.get("function", tool).get("name"), str):
                    raise ValueError(f"a tool without a name: {tool!r}")


@dataclass
class SamplingConfig:
    """How tokens are chosen. Applied identically to the target (p) and the draft (q)."""

    __pydantic_config__ = STRICT

    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # 0 disables
    top_p: float = 1.0  # 1.0 disables
    # History penalties (`sampling.penalize`), transformers' semantics, over the last
    # penalty_last_n tokens of prompt + reply (0: all); EOS is never penalised.
    repetition_penalty: float = 1.0  # >1 discourages tokens already in the window; 1.0 disables
    no_repeat_ngram_size: int = 0  # bans repeating an n-gram of the window; 0 disables
    penalty_last_n: int = 0
    seed: int | None = None
    max_new_tokens: int = 128
    # Decode all max_new_tokens past any EOS (vLLM's ignore_eos): throughput benchmarks, whose
    # every request must run to the same length. Not for replies.
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)
    # Constrained decoding: target and drafts are masked to the grammar (`llm_engine.grammar`).
    grammar: GrammarSpec | None = None

    def __post_init__(self) -> None:
        if self.repetition_penalty <= 0:
            raise ValueError("repetition_penalty must be > 0 (1.0 disables it)")
        if self.no_repeat_ngram_size < 0 or self.penalty_last_n < 0:
            raise ValueError("no_repeat_ngram_size and penalty_last_n must be >= 0")
        if self.ignore_eos and self.grammar is not None:
            raise ValueError("ignore_eos cannot go with a grammar, which ends in EOS")


@dataclass
class SpeculationConfig:
    """Which proposer drafts tokens, and how many per step."""

    __pydantic_config__ = STRICT

    # A method of `llm_engine.methods`, or "grammar+<one>": grammar drafts where a constrained
    # request's continuation is forced, <one> elsewhere.
    method: str = "ngram"
    num_draft_tokens: int = 4  # K until the request has measured its acceptance
    adaptive: bool = True  # K from the measured cost model and acceptance; False: always K
    min_draft_tokens: int = 1
    max_draft_tokens: int = 10  # a read-back accepts whole drafts; K doubles up to here
    # Turn speculation off for a request when drafting + verifying costs more than it saves.
    gate: bool = True
    gate_min_steps: int = 2  # speculative steps measured before the gate may close
    gate_reprobe_steps: int = 32  # plain steps before a closed gate tries again (doubles each time)
    gate_probe_draft_tokens: int = 2  # K cap while a re-opened gate probes
    ngram_min: int = 2  # a lone repeated token is a poor guess in free conversation
    ngram_max: int = 3

    def __post_init__(self) -> None:
        methods.check(self.method)


@dataclass
class EngineConfig:
    """The target model, the optional draft model, and where they run."""

    __pydantic_config__ = STRICT

    target: str = "smollm2-135m-instruct"
    draft: str | None = None  # a model name/path for method "draft"; the target itself is allowed
    eagle: str | None = None  # an EAGLE head (name/path) for method "eagle", trained for the target
    device: Literal["auto", "cpu", "cuda", "mps"] = "auto"
    # The weights' format: float32, bfloat16, float16, or the lean runner's weight-only int8 and
    # q4 (a GGUF's Q4_1 codes as they are). auto: bf16 on CUDA, fp16 on MPS; on a CPU the fastest
    # format here that keeps speculation bit-identical and agrees with fp32 above
    # format_min_agreement, measured once per machine, model and torch version (cached).
    format: Literal["auto", "float32", "bfloat16", "float16", "int8", "q4"] = "auto"
    format_min_agreement: float = 0.95  # teacher-forced top-1 agreement with fp32, 0..1
    # What runs the lean forward's layers on a CPU: auto, our own AVX512-VNNI kernels where they
    # build and the CPU has them (`llm_engine.lean.int_kernel`: the q4 and q8 products, and each
    # layer's norms, SiLU and short forwards' attention as one op each), else torch's; torch:
    # torch's always (its int4 kernel and its small ops).
    int_kernel: Literal["auto", "torch"] = "auto"
    # How the target runs: eager (any HF causal LM), compiled (static cache, torch.compile, CUDA
    # graphs on a GPU) or lean (`llm_engine.lean`: the Llama family's forward of our own, for
    # bfloat16, int8 and q4). auto: lean where it fits, else compiled on CUDA (where
    # transformers' static cache can be cropped) and eager otherwise.
    runner: Literal["auto", "eager", "compiled", "lean"] = "auto"
    max_context: int = 2048
    prefill_chunk: int = 256  # prompt tokens per engine step: bounds cancel latency and others' ITL
    # Live requests' decode and verify rows in one target forward where the runner can (the lean
    # runner): each request's tokens are unchanged; false runs one forward per request in turn.
    shared_forwards: bool = True
    # KV caches kept side by side in one block on the lean runner, so a shared forward attends
    # over the requests in consecutive slots at once. Each slot holds max_context positions,
    # allocated at load; a request past the slots gets a cache of its own and attends alone.
    # 0: every cache its own.
    kv_pool_slots: int = 4
    # A worker thread that dies (a failure no request's guard caught) fails what it held and
    # serves again after a backoff, up to this many times in 10 minutes; then it stays down.
    worker_restarts: int = 3
    # CPU threads of the engine's forward. auto: measured at load, beside the work the caller
    # says shares the cores (`llm_engine.threads`), and a caller may ask for another count while
    # other work runs (`EngineWorker.share_cores`); 0 keeps torch's default; n: n threads.
    threads: Literal["auto"] | int = "auto"
    speculation: SpeculationConfig = field(default_factory=SpeculationConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)

    def __post_init__(self) -> None:
        if self.threads != "auto" and self.threads < 0:
            raise ValueError(f"engine.threads must be auto, 0 (torch's default) or a count, "
                             f"not {self.threads}")
