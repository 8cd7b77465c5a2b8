"""`voiceagent bench serve`: the call server under simulated Twilio callers, end to end.

The server runs in this process on a loopback port; callers speak Media Streams to it at real-time
pace (voiceagent.sim.twilio_caller). Measured:

- Twilio round trip: the caller's last chunk of speech sent -> the first bot `media` received,
  over `turns` turns of one call (p50), beside the server's clock 3 for the same turns;
- barge-in -> `clear`: the caller starts speaking over the bot -> `clear` received;
- clock 3 with 1, 2, ... simultaneous calls: what sharing the CPU (and the engine) costs;
- memory: this process's RSS after the first call and after `soak` calls, one after another.
"""

from __future__ import annotations

import asyncio
import gc
import time

from audio.synth import synthesize
from voiceagent.bench.knee import knee, render_knee, variants
from voiceagent.bench.results import save_results, utc_stamp
from voiceagent.config import Config
from voiceagent.figures import fmt, percentile
from voiceagent.logs import progress_bar, write
from voiceagent.pipeline.builder import load_shared
from voiceagent.server.serve import serving_in_process
from voiceagent.sim.twilio_caller import TwilioCaller

QUESTIONS = [
    "What is the capital of France?",
    "How far away is the moon?",
    "What colour is the sky on a clear day?",
    "Can you recommend a good book?",
    "What time of year is best for skiing?",
]
STORY = "Tell me a long story about a brave little dragon."
STOP = "Stop, wait a moment please."
STORY_PROMPT = "Always answer with a long story of at least ten sentences."
REPLY_TIMEOUT_S = 90


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


class Bench:
    def __init__(self, cfg: Config, shared, say):
        self.cfg, self.shared, self.say = cfg, shared, say
        voice = shared.speech.voice
        self.speech = {t: synthesize(voice, t, 16000) for t in [*QUESTIONS, STORY, STOP]}

    async def turns(self, url: str, questions: list[str]) -> list[float]:
        """One call; each question waits for the whole reply (its mark). Round trips in ms."""
        trips = []
        async with TwilioCaller(url) as caller:
            await caller.start()
            await asyncio.sleep(0.5)
            for question in questions:
                said = await caller.say(self.speech[question])
                first = await caller.reply(said.ended, REPLY_TIMEOUT_S)
                if first is None:
                    closed = caller.received.close_code
                    why = (f"the server closed the call ({closed} "
                           f"{caller.received.close_reason})" if closed is not None
                           else f"no reply in {REPLY_TIMEOUT_S} s")
                    raise RuntimeError(f"{question!r}: {why}")
                trips.append(1000 * (first - said.ended))
            await caller.hang_up()
        return trips

    async def barge_in(self, url: str) -> float:
        async with TwilioCaller(url) as caller:
            await caller.start()
            said = await caller.say(self.speech[STORY])
            if not await caller.wait(lambda r: r.media_after(said.ended), REPLY_TIMEOUT_S):
                raise RuntimeError("the bot never started its story")
            await asyncio.sleep(1.0)
            barge = await caller.say(self.speech[STOP])
            if not await caller.wait(lambda r: any(t >= barge.started for t in r.clears), 10):
                raise RuntimeError("no clear after barge-in")
            await caller.hang_up()
            return 1000 * (min(t for t in caller.received.clears if t >= barge.started)
                           - barge.started)

    async def run(self, turns: int, concurrency: list[int], soak: int) -> dict:
        out: dict = {}
        async with serving_in_process(self.cfg, self.shared) as (app, base):
            url = base.replace("http://", "ws://") + "/telephony/twilio"
            records, slots = app.state.server.records, app.state.server.calls
            self.say(f"one call, {turns} turns")
            trips = await self.turns(url, QUESTIONS[:turns])
            await slots.wait_idle()  # its pipeline has ended and its turns are recorded
            [turn_records] = records.by_call.values()
            out["round_trip_ms"] = trips
            out["round_trip_clock3_ms"] = [t.clocks.turn_end_to_first_audio_ms
                                           for t in turn_records]
            out["concurrency"] = {}
            bar = progress_bar(len(concurrency) + soak, "bench serve", "step")
            for n in concurrency:
                self.say(f"{n} simultaneous call(s)")
                before = set(records.by_call)
                results = await asyncio.gather(*(self.turns(url, QUESTIONS[i:i + 2])
                                                 for i in range(n)))
                await slots.wait_idle()
                new = [c for c in records.by_call if c not in before]
                out["concurrency"][n] = {
                    "clock3_ms": [t.clocks.turn_end_to_first_audio_ms
                                  for c in new for t in records.by_call[c]],
                    "round_trip_ms": [x for r in results for x in r],
                }
                bar.update()
            self.say(f"memory: {soak} calls one after another")
            gc.collect()
            rss, objects = [rss_mb()], [len(gc.get_objects())]
            for i in range(soak):
                await self.turns(url, [QUESTIONS[i % len(QUESTIONS)]])
                await slots.wait_idle()  # no pipeline of it is alive when memory is read
                gc.collect()
                rss.append(rss_mb())
                objects.append(len(gc.get_objects()))
                bar.update()
            bar.close()
            out["rss_mb"] = {"before": rss[0], "after_1": rss[1], "after_n": rss[-1],
                             "n": soak, "series": rss}
            # Python objects alive: a leak of calls' pipelines would grow this by thousands.
            out["gc_objects"] = {"after_1": objects[1], "after_n": objects[-1],
                                 "series": objects}
            out["turn_records_kept"] = sum(len(v) for v in records.by_call.values())
        story_cfg = self.cfg.model_copy(deep=True)
        story_cfg.agent.system_prompt = STORY_PROMPT
        story_cfg.engine.sampling.max_new_tokens = 160
        async with serving_in_process(story_cfg, self.shared) as (story_app, base):
            self.say("barge-in x3")
            url = base.replace("http://", "ws://") + "/telephony/twilio"
            out["barge_in_to_clear_ms"] = []
            for _ in range(3):
                out["barge_in_to_clear_ms"].append(await self.barge_in(url))
                await story_app.state.server.calls.wait_idle()
        return out


def _p50(xs) -> str:
    return fmt(percentile([x for x in xs if x is not None], 50), 0)


def render(r: dict) -> str:
    rss = r["rss_mb"]
    lines = [
        "| figure | value |", "|---|--:|",
        f"| Twilio round trip (speech end → first bot media), p50 over "
        f"{len(r['round_trip_ms'])} turns | {_p50(r['round_trip_ms'])} ms |",
        f"| server clock 3 (turn end → first audio), same turns, p50 | "
        f"{_p50(r['round_trip_clock3_ms'])} ms |",
        f"| barge-in (caller speech onset) → `clear` received, p50 of "
        f"{len(r['barge_in_to_clear_ms'])} | {_p50(r['barge_in_to_clear_ms'])} ms |",
    ]
    for n, c in r["concurrency"].items():
        lines.append(f"| {n} simultaneous call(s): clock 3 p50 / round trip p50 "
                     f"({len(c['clock3_ms'])} turns) | {_p50(c['clock3_ms'])} / "
                     f"{_p50(c['round_trip_ms'])} ms |")
    lines.append(f"| RSS after 1 call / after {rss['n']} calls (before: {rss['before']:.0f} MB) | "
                 f"{rss['after_1']:.0f} / {rss['after_n']:.0f} MB |")
    objs = r["gc_objects"]
    lines.append(f"| Python objects alive after 1 call / after {rss['n']} calls | "
                 f"{objs['after_1']} / {objs['after_n']} |")
    return "\n".join(lines)


def run_serve_bench(cfg: Config, args) -> int:
    say = write  # progress on stderr, above a bar on a terminal
    default_calls = "1,2,3,4,5,6" if args.knee else "1,2,3"
    concurrency = [int(x) for x in (args.calls or default_calls).split(",")]
    if args.repeats < 1:
        raise ValueError(f"--repeats takes a count of passes of at least 1, not {args.repeats}")
    shared = load_shared(cfg, say)
    try:
        t0 = time.monotonic()
        bench = Bench(cfg, shared, say)
        if args.knee:
            methods = list(dict.fromkeys(["off", cfg.engine.speculation.method]))
            audio = [bench.speech[q] for q in QUESTIONS[:args.turns]]
            runs = variants(methods, args.compare_shared_forwards)
            result = asyncio.run(knee(cfg, shared, audio, concurrency, runs,
                                      args.threshold_ms, say, args.repeats))
            body, name = render_knee(result), "serve-knee"
        else:  # this bench measures how calls share the machine: admit them all
            cfg.server.max_calls = max(cfg.server.max_calls, *concurrency)
            result = asyncio.run(bench.run(args.turns, concurrency, args.soak))
            body, name = render(result), "serve"
    finally:
        shared.close()
    stamp = utc_stamp()
    markdown = (f"# Server benchmark (Twilio Media Streams)\n\n- {stamp}, target "
                f"`{cfg.engine.target}`, speculation {cfg.engine.speculation.method}, "
                f"{time.monotonic() - t0:.0f} s\n\n{body}\n")
    save_results(args.out, name, stamp, markdown, result)
    return 0
