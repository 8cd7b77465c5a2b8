"""The root config: one typed section per component, loaded from YAML plus `--set` overrides.

Each component owns its own config type (engine and audio ones live in their packages); this
module only composes them and turns validation failures into one-line errors that list the
valid choices.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import importlib.resources
import os
import re
import typing
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from audio.config import ASRConfig, TTSConfig, VADConfig
from llm_engine import methods
from llm_engine.config import EngineConfig

REPO_ROOT = Path(__file__).resolve().parent.parent  # the checkout, when run from one
SHIPPED_CONFIGS = "_configs"  # configs/ inside an installed wheel (setup.py copies it there)


def _configs_dir() -> Path:
    """The folder of the shipped configs and prompt sets: `voiceagent/_configs` in an installed
    wheel, else the checkout's top-level configs/ (an editable install or a plain checkout)."""
    shipped = importlib.resources.files("voiceagent") / SHIPPED_CONFIGS
    if isinstance(shipped, Path) and (shipped / "default.yaml").is_file():
        return shipped
    return REPO_ROOT / "configs"


CONFIGS_DIR = _configs_dir()
PROMPTS_DIR = CONFIGS_DIR / "prompts"
DEFAULT_CONFIG = CONFIGS_DIR / "default.yaml"


class ConfigError(ValueError):
    """Bad config file or override; the message says which key and what is allowed."""


class IceServerConfig(BaseModel):
    """One STUN/TURN server for browser calls (WebRTC's RTCIceServer)."""

    model_config = ConfigDict(extra="forbid")
    urls: str | list[str]
    username: str | None = None
    credential: str | None = None


class ServerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    host: str = "127.0.0.1"
    port: int = Field(7860, ge=1, le=65535)
    # Shared token for /api/offer, /telephony/twilio and the dashboard; env VOICEAGENT_TOKEN.
    token: str | None = None
    # Enables Twilio request-signature validation; env TWILIO_AUTH_TOKEN.
    twilio_auth_token: str | None = None
    # The URL the public reaches us at (e.g. https://abc.ngrok.app), when behind a proxy: Twilio
    # signs the URL it requested, not the one we see.
    public_url: str | None = None
    # Off loopback, `serve` refuses to start without `token` (and Twilio calls without
    # `twilio_auth_token`) unless this says the operator means it (`serve --insecure-public`).
    allow_public_without_token: bool = False
    # Host header names accepted (DNS rebinding); empty: loopback names, `host` and the host of
    # `public_url`, or any name when `host` binds every interface (the token guards those).
    allowed_hosts: list[str] = Field(default_factory=list)
    # Origins other than the server's own that browsers may call it from.
    allowed_origins: list[str] = Field(default_factory=list)
    # The hard cap on calls at once; below it a call is admitted while the turns measured lately
    # predict every call's clock 3 p95 within admit_clock3_ms (`server/admission.py`; 0: admit
    # up to max_calls).
    max_calls: int = Field(4, ge=1)
    admit_clock3_ms: float = Field(1500.0, ge=0)
    # While any call's reply is on its way to its first audio, Whisper's and Piper's background
    # jobs (other callers' interims, later phrases) wait up to this long, so the cores go to that
    # reply's first phrase (docs/BENCHMARKS.md, "Four callers: background speech waits while a
    # reply opens"). 0: off.
    opening_hold_ms: float = Field(500.0, ge=0)
    # The A/B baseline: this share of calls runs with speculation off (the in-process engine
    # only), spread evenly over the calls, so the dashboard's ITL speed-up fills itself from live
    # traffic. 0: every call uses engine.speculation.method.
    ab_off_share: float = Field(0.1, ge=0.0, le=1.0)
    max_api_requests: int = Field(2, ge=1)  # /v1/chat/completions requests at once (429)
    max_message_bytes: int = Field(64 * 1024, ge=1024)
    idle_timeout_s: float = Field(60.0, gt=0)
    max_call_s: float = Field(3600.0, gt=0)  # a call this long is ended
    # On SIGTERM or POST /admin/drain: new calls are refused (503, `/healthz` "draining") and the
    # calls in progress may finish for this long before the process stops. 0: stop at once.
    drain_timeout_s: float = Field(300.0, ge=0)
    # A peer that has not read what we sent for this long has lost its call.
    send_timeout_s: float = Field(10.0, gt=0)
    # The kernel's send buffer per connection (SO_SNDBUF; Linux doubles it). Autotuned, it grows
    # to 4 MB, which holds minutes of a call's audio: a peer that stopped reading would be noticed
    # only then. 0: the kernel's autotuning.
    send_buffer_bytes: int = Field(64 * 1024, ge=0)
    # STUN/TURN servers for browser calls: GET /api/ice gives them to the page, and the server's
    # peer connections use them too. []: host candidates only (same network or loopback).
    ice_servers: list[IceServerConfig] = Field(default_factory=list)
    close_timeout_s: float = Field(3.0, gt=0)  # waiting for a close handshake, after cancelling
    start_timeout_s: float = Field(5.0, gt=0)  # a Twilio socket must send `start` within this
    # A browser call's peer connection must connect within this after its offer, or the call
    # ends and its slot is free (an offer whose ICE never completes would hold it until idle).
    connect_timeout_s: float = Field(15.0, gt=0)
    max_handshakes_per_client: int = Field(4, ge=1)  # Twilio sockets waiting for `start`, per IP
    # Media: one Twilio payload at most this many μ-law bytes (Twilio sends 160: 20 ms), and no
    # faster than `max_media_speed` x real time beyond a burst of `media_burst_s` seconds.
    max_media_payload_bytes: int = Field(1600, ge=160)
    max_media_speed: float = Field(1.5, ge=1.0)
    media_burst_s: float = Field(2.0, gt=0)
    max_event_subscribers: int = Field(16, ge=1)  # open /api/events streams
    # The pages' sign-in: a session cookie lasts this long (sign-out ends it sooner), and one
    # client address may try to sign in this often a minute (then 429 with Retry-After).
    session_ttl_s: float = Field(12 * 3600.0, ge=60)
    session_attempts_per_min: int = Field(10, ge=1)


class TurnConfig(BaseModel):
    """Turn-taking: when the caller's turn ends, early preparation, and what may interrupt."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    # Start the reply at the caller's first pause, held until the turn is confirmed with the
    # same transcript (committed) or dropped when the caller goes on (discarded).
    prepare: bool = True
    # vad: the turn ends at the VAD stop (its stop_secs hangover); smart_turn: pipecat's local
    # Smart Turn v3 model decides whether the pause ends the sentence.
    stop: Literal["vad", "smart_turn"] = "vad"
    # vad: a turn whose final words sound unfinished (ending on "and", "the", "um", a short group
    # of digits, or no closing punctuation) waits this much longer after the VAD's stop_secs for
    # the caller to go on, so stop_secs can be short for a finished sentence. Longer than a
    # thinking pause less stop_secs plus the VAD's start_secs (speech resumed is heard that late):
    # 1.0 s keeps a caller's 0.7 s pause one turn. 0: off.
    unfinished_hold_s: float = Field(1.0, ge=0)
    # vad: a caller who went on after a pause in this turn is waited on this much longer at each
    # later pause, even where the words end finished: a hesitant caller pauses again, and a comma
    # pause just past stop_secs would end "What is the capital ... of Spain, [pause] and why" on
    # "of Spain." Longer than the VAD's start_secs, so speech resumed at the stop is heard. 0: off.
    resumed_hold_s: float = Field(0.3, ge=0)
    # vad, with the in-process engine: the target's log-probability that the caller's message
    # or its sentence ends there (case and punctuation aside) below this says the words go on.
    # Most finished messages score -0.1 to -6 on the embedded SmolLM2 (a bare "can you help
    # me" -10), most fragments ("what is the capital" -8.4) -6 to -14 (`voiceagent bench cue`
    # shows them for the configured target). null: the words alone decide.
    unfinished_logprob: float | None = Field(-7.0, le=0)
    # Which turns that score decides. always: every turn not plainly unfinished, which also
    # holds "What is the capital?" (a hesitant caller stays one turn); words that end finished
    # are scored only while the engine has no reply in flight. unsure: only words with
    # no closing punctuation and no continuing last word, which would otherwise wait the hold
    # (Whisper leaves a finished fragment such as "of Spain and why is it there" bare): a
    # score less on most turns, for an engine too busy to spare one.
    unfinished_cue: Literal["unsure", "always"] = "always"
    # While the bot speaks, the caller takes the turn only by speaking this long (seconds), or by
    # saying this many words (pipecat's min-words strategy), so a "mm-hmm" or a cough does not cut
    # it off. Both 0: any speech the VAD hears interrupts at once.
    min_interrupt_s: float = Field(0.0, ge=0)
    min_interrupt_words: int = Field(0, ge=0)
    # Speech that interrupts a reply before any of its audio was heard, or within this long
    # (seconds) of its first audio with none of its clauses played to the end, goes on with the
    # caller's sentence: "What is the capital" / "The" / "of Spain?". The reply is withdrawn
    # and their words before and after are one message (continuation.py). Later speech is a
    # barge-in (a new turn). 0: every interruption starts a new turn.
    continue_within_s: float = Field(1.0, ge=0)
    # The bot's speech does not start while the caller's voice is rising (the VAD's first voiced
    # window, before it confirms speech): it waits until the voice falls quiet, or is dropped
    # when the voice interrupts it (onset_hold.py). Off: the reply plays as soon as it is ready.
    yield_to_voice: bool = True
    # Keys pressed (DTMF) are one user turn, sent this long after the last key, or at once on
    # the termination key ("": none).
    dtmf_timeout_s: float = Field(2.0, gt=0)
    dtmf_termination: Literal["#", "*", ""] = "#"


class AgentConfig(BaseModel):
    """What the bot is: its instructions for the LLM."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    system_prompt: str = (
        "You are a friendly, concise voice assistant on a phone call. "
        "Answer in one or two short sentences."
    )
    # Tool entries (voiceagent.tools: a module path with a TOOLS list, or one mapping).
    tools: list[str | dict[str, Any]] = []
    tool_timeout_s: float = Field(5.0, gt=0)  # longer, and the tool's result is an error
    max_tool_calls: int = Field(1, ge=1)  # per caller turn; then the reply must be words
    tool_filler_after_s: float = Field(1.0, ge=0)  # a tool still running then: say the filler
    tool_filler: str = "One moment, please."
    # A tool's `say` template speaks its result at once; false: the model always answers.
    tool_templates: bool = True
    # Said after a tool that ends the call, which then hangs up; "": the model says its own.
    goodbye: str = "Thank you for calling. Goodbye!"
    # Said when a turn's LLM request fails or times out, so the caller knows to say it again;
    # "": silence (the turn is stored with its error either way).
    error_reply: str = "Sorry, I missed that. Could you say it again?"
    # A short example exchange after the system prompt, showing an answer that does not repeat
    # the caller's words; prefilled once per call with the system prompt.
    examples: list[AgentExample] = []

    def example_messages(self) -> list[dict[str, str]]:
        """The examples as chat messages, in order."""
        return [m for e in self.examples for m in (
            {"role": "user", "content": e.user}, {"role": "assistant", "content": e.assistant})]


class AgentExample(BaseModel):
    """One exchange of `agent.examples`: what a caller says and how the bot answers."""

    model_config = ConfigDict(extra="forbid")

    user: str = Field(min_length=1)
    assistant: str = Field(min_length=1)


class StoreConfig(BaseModel):
    """The durable turn store the dashboard and `voiceagent report` read."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    path: str | None = None  # SQLite file; default <paths.runs_dir>/turns.sqlite
    # A PostgreSQL URL (postgresql://user@host:5432/db) shared by several `serve` processes, so
    # one dashboard shows them all; None: the SQLite file. A password belongs in the environment
    # (VOICEAGENT_STORE__URL or libpq's PGPASSWORD), not in a file.
    url: str | None = None
    # Store (and so show on the dashboard) what the caller and the bot said; false keeps only
    # the clocks and the engine stats.
    transcripts: bool = True
    # Record each call (caller left, bot right; one WAV per call), for operators to hear a slow
    # turn. Off by default: recording a caller needs their consent where the law asks for it.
    audio: bool = False
    # Where recordings go; default <paths.runs_dir>/recordings. With a PostgreSQL store shared
    # by several machines, a folder they all mount (a bucket), so any dashboard can play any call.
    audio_dir: str | None = None
    # Older calls, turns and recordings deleted; None: keep.
    retention_days: float | None = Field(30.0, gt=0)
    max_queue: int = Field(10_000, ge=1)  # writes waiting for the store; beyond: spilled to disk
    # The dashboard's statistics read at most this many of the newest turns.
    max_dashboard_turns: int = Field(10_000, ge=1)


class LLMConfig(BaseModel):
    """Which LLM the pipeline talks to: the in-process engine, or a remote OpenAI-compatible
    server (vLLM, SGLang, llama.cpp's server, another `voiceagent serve`)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    backend: Literal["engine", "openai"] = "engine"
    base_url: str | None = None  # the remote's API root, e.g. http://127.0.0.1:8000/v1
    model: str | None = None  # None: the server's only model
    api_key_env: str = "OPENAI_API_KEY"  # the variable holding the key; keys never go in files
    # Shown as the method on the dashboard (e.g. vllm-ngram); None: the server's own name.
    name: str | None = None
    # Prometheus text of the remote, for vLLM's speculation counters; None: <base_url root>/metrics.
    metrics_url: str | None = None
    timeout_s: float = Field(30.0, gt=0)  # connect and first-byte timeout of one request
    # What serves a request when this backend fails before its first token or gives none within
    # `first_token_timeout_s` (`voiceagent.pipeline.failover`): another OpenAI-compatible server
    # (`backend: openai` and its `base_url`...) or the in-process engine (`backend: engine`).
    fallback: LLMConfig | None = None
    first_token_timeout_s: float = Field(2.0, gt=0)

    @model_validator(mode="after")
    def _one_fallback(self) -> LLMConfig:
        if self.fallback is not None:
            if self.fallback.fallback is not None:
                raise ValueError("llm.fallback has a fallback of its own: one is the limit")
            if self.fallback.backend == self.backend == "engine":
                raise ValueError("llm.fallback is the in-process engine, as is llm.backend")
        return self


class PathsConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    cache_dir: str = "~/.cache/voiceagent"  # de-quantised GGUF weights and file hashes
    runs_dir: str = "runs"  # per-call turn records


class TelemetryConfig(BaseModel):
    """Each finished turn as an OpenTelemetry trace, for operators who collect traces."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    # An OTLP/HTTP traces endpoint (http://collector:4318/v1/traces); None: no traces.
    otlp_endpoint: str | None = None
    # Headers for the collector (an API key); from the environment rather than a file:
    # VOICEAGENT_TELEMETRY__HEADERS='{"x-api-key": "..."}'.
    headers: dict[str, str] = Field(default_factory=dict)
    service_name: str = "voiceagent"


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    engine: EngineConfig = Field(default_factory=EngineConfig)
    llm: LLMConfig = Field(default_factory=LLMConfig)
    asr: ASRConfig = Field(default_factory=ASRConfig)
    tts: TTSConfig = Field(default_factory=TTSConfig)
    vad: VADConfig = Field(default_factory=VADConfig)
    turn: TurnConfig = Field(default_factory=TurnConfig)
    server: ServerConfig = Field(default_factory=ServerConfig)
    agent: AgentConfig = Field(default_factory=AgentConfig)
    store: StoreConfig = Field(default_factory=StoreConfig)
    paths: PathsConfig = Field(default_factory=PathsConfig)
    telemetry: TelemetryConfig = Field(default_factory=TelemetryConfig)

    @model_validator(mode="after")
    def _replies_end(self) -> Config:
        if self.engine.sampling.ignore_eos:
            raise ValueError("engine.sampling.ignore_eos is for throughput benchmarks: a reply "
                             "must end at its EOS")
        return self


def store_path(cfg: Config) -> Path:
    return Path(cfg.store.path or Path(cfg.paths.runs_dir) / "turns.sqlite").expanduser()


def config_hash(cfg: Config) -> str:
    """A short stable hash of the whole config, stored with each call (what ran it)."""
    return hashlib.sha256(cfg.model_dump_json().encode()).hexdigest()[:16]


ENV_PREFIX = "VOICEAGENT_"


def env_overrides(environ=os.environ) -> list[tuple[str, str]]:
    """(variable, `key=value`) for every `VOICEAGENT_SECTION__KEY[__KEY...]` variable: any
    config key from the environment, e.g. VOICEAGENT_ENGINE__SPECULATION__METHOD=off. Only names
    with `__` count, so VOICEAGENT_TOKEN and other plain names are not config paths."""
    found = []
    for name, value in sorted(environ.items()):
        if name.startswith(ENV_PREFIX) and "__" in name:
            path = name[len(ENV_PREFIX):].lower().replace("__", ".")
            found.append((name, f"{path}={value}"))
    return found


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Read a YAML config (the CPU default when None) and the files it `extends`, then the
    environment's settings (`env_overrides`), then `key=value` overrides (`--set`), and validate.
    An error names where the bad key came from: the file, the variable or the `--set` flag."""
    path = config_path(path)
    origins: dict[tuple[str, ...], str] = {}  # key path -> where it was set
    data = _read_config_file(path, origins, ())
    for name, item in env_overrides():
        _override(data, item, f"environment variable {name}", origins)
    for item in overrides or []:
        _override(data, item, f"--set {item}", origins)
    server = data.setdefault("server", {}) or {}
    # Secrets from the environment, so they never go on a command line.
    for key, env in (("token", "VOICEAGENT_TOKEN"), ("twilio_auth_token", "TWILIO_AUTH_TOKEN")):
        if server.get(key) is None and os.environ.get(env):
            server[key] = os.environ[env]
            origins["server", key] = f"environment variable {env}"
    data["server"] = server
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_describe(exc, data, origins)) from None


def shipped_configs() -> list[str]:
    return sorted(p.name for p in CONFIGS_DIR.glob("*.yaml"))


def _read_config_file(path: Path, origins: dict, chain: tuple[Path, ...]) -> dict:
    """One file's mapping, deep-merged over the file it `extends` (which it overrides)."""
    if path.resolve() in chain:
        loop = " -> ".join(str(p) for p in (*chain, path.resolve()))
        raise ConfigError(f"config file {path} extends itself: {loop}")
    try:
        data = yaml.load(path.read_text(), Loader=YamlLoader) or {}
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path} (shipped configs, usable by name: "
                          f"{', '.join(shipped_configs())}, in {CONFIGS_DIR})") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections")
    base_name = data.pop("extends", None)
    base: dict = {}
    if base_name is not None:
        if not isinstance(base_name, str):
            raise ConfigError(f"config file {path}: extends takes one file name, e.g. "
                              f"extends: default.yaml (got {base_name!r})")
        base = _read_config_file(_extended_path(base_name, path), origins,
                                 (*chain, path.resolve()))
    for key in _leaf_paths(data):
        origins.pop(key, None)  # re-inserted: the later a source, the later in the dict
        origins[key] = f"config file {path}"
    return _merge(base, data)


def _extended_path(name: str, child: Path) -> Path:
    """The file `extends: name` means: beside the file that says it, else a shipped config."""
    beside = child.parent / name
    if beside.is_file():
        return beside
    shipped = config_path(name)
    if shipped.is_file():
        return shipped
    raise ConfigError(f"config file {child}: extends '{name}', which is neither beside it nor a "
                      f"shipped config ({', '.join(shipped_configs())})")


def _merge(base: dict, top: dict) -> dict:
    """`top` over `base`: sections merge key by key; a value (lists too) replaces the base's."""
    merged = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _leaf_paths(data: dict, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    paths = []
    for key, value in data.items():
        here = (*prefix, str(key))
        paths += _leaf_paths(value, here) if isinstance(value, dict) and value else [here]
    return paths


def _override(data: dict, item: str, source: str, origins: dict) -> None:
    try:
        parts = apply_override(data, item)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    origins.pop(tuple(parts), None)
    origins[tuple(parts)] = source


def config_path(path: str | Path | None) -> Path:
    """The config file to read: `path` when it exists; else, for a name of a shipped config
    (`gpu-qwen2.5-7b.yaml`, `configs/gpu-qwen2.5-7b.yaml`), the shipped file, so an installed
    package takes the README's `--config configs/...` from any directory."""
    if not path:
        return DEFAULT_CONFIG
    path = Path(path)
    if path.exists() or path.is_absolute():
        return path
    parts = path.parts[1:] if path.parts[:1] == ("configs",) else path.parts
    shipped = CONFIGS_DIR.joinpath(*parts) if parts else None
    return shipped if shipped is not None and shipped.is_file() else path


class YamlLoader(yaml.SafeLoader):
    """YAML 1.2 booleans: only true and false, so `method: off` is the string "off"."""


YamlLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))


def apply_override(data: dict, item: str) -> list[str]:
    """Set `a.b.c=value` in a nested dict; the value is parsed as YAML (numbers, bools, lists).
    Returns the key's parts."""
    key, sep, raw = item.partition("=")
    if not sep or not key:
        raise ConfigError(f"override '{item}' must look like key=value, e.g. engine.device=cpu")
    parts = key.strip().split(".")
    _check_key_path(parts)
    try:
        value = yaml.load(raw, Loader=YamlLoader)
    except yaml.YAMLError:
        value = raw
    node = data
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = node[part] = {}
        node = child
    node[parts[-1]] = value
    return parts


def _fields(tp: Any) -> dict[str, Any] | None:
    """Field name -> type of a config class, or None for a leaf type."""
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return {name: f.annotation for name, f in tp.model_fields.items()}
    if dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        return {f.name: hints[f.name] for f in dataclasses.fields(tp)}
    return None


def did_you_mean(value: Any, choices: list[str]) -> str:
    """"did you mean 'x'?" for the nearest choice to a mistyped string, else ""."""
    if not isinstance(value, str):
        return ""
    close = difflib.get_close_matches(value, choices, n=1, cutoff=0.6)
    return f"did you mean '{close[0]}'?" if close else ""


def _unknown_key(parts: list[str] | tuple[str, ...], fields: list[str]) -> str:
    guess = did_you_mean(parts[-1], fields)
    return (f"unknown config key '{'.'.join(parts)}'{f' ({guess})' if guess else ''}; "
            f"valid keys: {', '.join(fields)}")


def _check_key_path(parts: list[str]) -> None:
    tp: Any = Config
    for depth, part in enumerate(parts):
        fields = _fields(tp)
        where = ".".join(parts[:depth]) or "the config"
        if fields is None:
            raise ConfigError(f"'{where}' is a value, it has no key '{part}'")
        if part not in fields:
            raise ConfigError(_unknown_key(parts[:depth + 1], list(fields)))
        tp = fields[part]
    if _fields(tp) is not None:
        raise ConfigError(
            f"'{'.'.join(parts)}' is a section; set one of its keys: {', '.join(_fields(tp))}"
        )


def _describe(exc: ValidationError, data: dict, origins: dict[tuple[str, ...], str]) -> str:
    """One line per bad key: where it was set, the key, what is wrong, the nearest valid value."""
    lines = []
    for err in exc.errors():
        loc = tuple(str(p) for p in err["loc"])
        if err["type"] in ("extra_forbidden", "unexpected_keyword_argument"):
            problem = _unknown_key(loc, list(_fields(_type_at(loc[:-1])) or {}))
        else:
            loc = _bad_key(loc, err, data)
            value = _value_at(data, loc)
            msg = err["msg"].removeprefix("Value error, ")
            if not isinstance(value, dict) and repr(value) not in msg:
                msg += f" (got {value!r})"
            guess = did_you_mean(value, setting_choices(loc))
            problem = f"{msg}; {guess}" if guess else msg
            if not origins.get(loc, "").startswith("--set "):  # that flag names the key
                problem = f"{'.'.join(loc)}: {problem}"
        lines.append(f"{_origin(loc, origins)}: {problem}")
    return "; ".join(lines)


_MISSING = object()


def _value_at(data: dict, loc: tuple[str, ...]) -> Any:
    node: Any = data
    for part in loc:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return _MISSING
    return node


def _bad_key(loc: tuple[str, ...], err: dict, data: dict) -> tuple[str, ...]:
    """A section's own check (a dataclass's __post_init__) fails the whole section: the bad key
    is the one whose value the message quotes, e.g. 'eagel' in "unknown speculation method
    'eagel'"."""
    section = _value_at(data, loc)
    if _fields(_type_at(loc)) is None or not isinstance(section, dict):
        return loc
    quoted = re.findall(r"'([^']+)'", err["msg"])
    keys = [key for key, value in section.items()
            if isinstance(value, str) and any(q in value for q in quoted)]
    return (*loc, keys[0]) if len(keys) == 1 else loc


def setting_choices(loc: tuple[str, ...]) -> list[str]:
    """The valid values of a key (its path) that takes one of a set of names."""
    if loc == ("engine", "speculation", "method"):
        return methods.choices()
    tp = _type_at(loc)
    options = typing.get_args(tp) if typing.get_origin(tp) is not Literal else (tp,)
    return [str(value) for option in options if typing.get_origin(option) is Literal
            for value in typing.get_args(option)]


def _origin(loc: tuple[str, ...], origins: dict[tuple[str, ...], str]) -> str:
    """Where the key at `loc` (or the nearest section above it) was set."""
    for depth in range(len(loc), 0, -1):
        if loc[:depth] in origins:
            return origins[loc[:depth]]
    below = [source for key, source in origins.items() if key[:len(loc)] == loc]
    return below[-1] if below else "config"


def _type_at(loc: tuple[str, ...] | list[str]) -> Any:
    tp: Any = Config
    for part in loc:
        fields = _fields(tp)
        if fields is None or part not in fields:
            return None
        tp = fields[part]
    return tp
