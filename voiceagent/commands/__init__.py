"""The commands that are neither the server, a bench nor a simulated peer: `chat` (a text chat with
the engine), `doctor` (checks the install), `report` (an HTML report from the turn store). The
parser in `voiceagent.cli` dispatches to them."""
