"""The simulated Twilio callers of `bench serve --knee`, in a process of their own.

In the server's process, four callers' websockets, μ-law encoding and pacing took about a fifth
of the event loop that the calls' pipelines need (py-spy, 4 callers), so the bench measured the
server with its load's own cost on its loop. A caller on the phone costs the server nothing of
that; here the callers still share the machine's cores, but not the server's event loop and GIL.

`python -m voiceagent.bench.callers` reads a job (JSON on stdin: url, audio paths, callers,
stagger_s) and prints each caller's outcome as a JSON list on its last line.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import numpy as np

from voiceagent.sim.twilio_caller import TwilioCaller

REPLY_TIMEOUT_S = 120


async def conversation(url: str, audio: list, offset_s: float) -> str:
    """One caller: 'done', 'refused' (1013) or 'failed' (no reply in time)."""
    await asyncio.sleep(offset_s)
    async with TwilioCaller(url) as caller:
        await caller.start()
        await asyncio.sleep(0.5)
        for speech in audio:
            said = await caller.say(speech)
            replied = await caller.wait(lambda r, t=said.ended: r.media_after(t) is not None
                                        or r.close_code is not None, REPLY_TIMEOUT_S)
            if caller.received.close_code == 1013:
                return "refused"
            if not replied or caller.received.close_code is not None:
                return "failed"
            await caller.wait(lambda r, t=said.ended: any(m >= t for m, _ in r.marks), 30)
        await caller.hang_up()
    return "done"


async def call_from_another_process(url: str, audio: list[Path], callers: int,
                                    stagger_s: float) -> list[str]:
    """`callers` conversations (each saying the `.npy` clips in `audio`), started `stagger_s`
    apart, from a child process; their outcomes in start order."""
    job = {"url": url, "audio": [str(p) for p in audio], "callers": callers,
           "stagger_s": stagger_s}
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "voiceagent.bench.callers", stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await child.communicate(json.dumps(job).encode())
    finally:
        if child.returncode is None:  # the bench was stopped: so are its callers
            child.kill()
    lines = out.decode().strip().splitlines()
    if child.returncode or not lines:
        raise RuntimeError(f"the callers' process exited {child.returncode}: "
                           f"{err.decode(errors='replace')[-2000:]}")
    return json.loads(lines[-1])


async def _run(job: dict) -> list[str]:
    audio = [np.load(path) for path in job["audio"]]
    return list(await asyncio.gather(*(
        conversation(job["url"], audio, i * job["stagger_s"]) for i in range(job["callers"]))))


def main() -> int:
    print(json.dumps(asyncio.run(_run(json.loads(sys.stdin.read())))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
