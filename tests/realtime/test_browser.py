"""The web page in real headless Chromium, against the real app over the tiny models, all on loopback.

Chromium is driven through the DevTools protocol on its own websocket (no browser-automation
packages). The test plays speech through WebRTC, uploads a voice through the page's form, plays speech
in that voice through the websocket player, shows a server error, and reads what the page exposes in
``window.__rt``. The instruction box's text reaches the LLM engine (recorded on the real engine) over
both transports.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import soundfile
import websockets
from testing import LiveServer, serve, service_config

from engines.build.synthetic import voiced_clip
from engines.config import SAMPLE_RATE
from engines.llm.base import LLMRequest, PromptMode
from realtime.config import WebRTCConfig

pytestmark = [pytest.mark.browser, pytest.mark.asyncio(loop_scope="session")]

CHROMIUM = shutil.which("chromium")
LOOPBACK = "127.0.0.1"
SCREENSHOT = Path("/tmp/page.png")
WAIT_S = 60.0
CHROMIUM_FLAGS = (
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
    "--allow-loopback-in-peer-connection",
    "--autoplay-policy=no-user-gesture-required",
    "--use-fake-ui-for-media-stream",
    # Real addresses in ICE candidates instead of mDNS names, which nothing on loopback resolves.
    "--disable-features=WebRtcHideLocalIpsWithMdns",
    "--remote-debugging-port=0",
    "--window-size=900,1000",
)


class DevTools:
    """A small Chrome DevTools Protocol client: one page session over the browser's websocket.

    Replies are matched to commands by id; console messages and uncaught exceptions of the page are
    kept in ``console`` and ``exceptions`` for assertions and failure messages.
    """

    def __init__(self, socket: websockets.ClientConnection) -> None:
        self._socket = socket
        self._ids = itertools.count(1)
        self._replies: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._session = ""
        self.console: list[str] = []
        self.exceptions: list[str] = []
        self._reader = asyncio.create_task(self._read())

    async def attach_to_page(self) -> None:
        targets = await self.call("Target.getTargets")
        page = next(t for t in targets["targetInfos"] if t["type"] == "page")
        attached = await self.call("Target.attachToTarget", {"targetId": page["targetId"], "flatten": True})
        self._session = attached["sessionId"]
        await self.call("Runtime.enable", page=True)
        await self.call("Page.enable", page=True)

    async def call(
        self, method: str, params: dict[str, Any] | None = None, page: bool = False
    ) -> dict[str, Any]:
        command_id = next(self._ids)
        reply = self._replies[command_id] = asyncio.get_running_loop().create_future()
        message: dict[str, Any] = {"id": command_id, "method": method, "params": params or {}}
        if page:
            message["sessionId"] = self._session
        await self._socket.send(json.dumps(message))
        answer = await asyncio.wait_for(reply, WAIT_S)
        if "error" in answer:
            raise RuntimeError(f"{method} failed: {answer['error']}")
        return answer["result"]

    async def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (promises awaited)."""
        params = {"expression": expression, "awaitPromise": True, "returnByValue": True}
        result = await self.call("Runtime.evaluate", params, page=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression!r} threw: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def navigate(self, url: str) -> None:
        await self.call("Page.navigate", {"url": url}, page=True)

    async def choose_file(self, selector: str, path: Path) -> None:
        """Put ``path`` into the page's file input at ``selector``, as a user picking it would."""
        document = await self.call("DOM.getDocument", page=True)
        node = await self.call(
            "DOM.querySelector", {"nodeId": document["root"]["nodeId"], "selector": selector}, page=True
        )
        await self.call("DOM.setFileInputFiles", {"files": [str(path)], "nodeId": node["nodeId"]}, page=True)

    async def wait_for(self, expression: str) -> None:
        """Poll until the expression is truthy in the page."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + WAIT_S
        while loop.time() < deadline:
            if await self.evaluate(expression):
                return
            await asyncio.sleep(0.1)
        state = await self.evaluate("JSON.stringify(window.__rt)")
        raise AssertionError(f"never true: {expression}\npage state: {state}\nconsole: {self.console[-10:]}")

    async def close(self) -> None:
        self._reader.cancel()
        await self._socket.close()

    async def _read(self) -> None:
        async for raw in self._socket:
            message = json.loads(raw)
            if "id" in message:
                reply = self._replies.pop(message["id"], None)
                if reply is not None and not reply.done():
                    reply.set_result(message)
            elif message.get("method") == "Runtime.consoleAPICalled":
                args = message["params"]["args"]
                self.console.append(" ".join(str(a.get("value", a.get("description", ""))) for a in args))
            elif message.get("method") == "Runtime.exceptionThrown":
                self.exceptions.append(json.dumps(message["params"]["exceptionDetails"]))


@contextlib.asynccontextmanager
async def chromium(url: str, profile: Path) -> AsyncIterator[DevTools]:
    """Headless Chromium with a fresh profile, navigated to ``url``, driven through DevTools."""
    assert CHROMIUM is not None
    process = await asyncio.create_subprocess_exec(
        CHROMIUM,
        *CHROMIUM_FLAGS,
        f"--user-data-dir={profile}",
        url,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        port, path = await _devtools_address(profile / "DevToolsActivePort")
        socket = await websockets.connect(f"ws://{LOOPBACK}:{port}{path}", max_size=None)
        devtools = DevTools(socket)
        try:
            await devtools.attach_to_page()
            await devtools.navigate(url)
            yield devtools
        finally:
            with contextlib.suppress(RuntimeError, websockets.ConnectionClosed):
                await devtools.call("Browser.close")
            await devtools.close()
    finally:
        if process.returncode is None:
            process.terminate()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(10):
                await process.wait()
        if process.returncode is None:
            process.kill()
            await process.wait()


def _words_of(path: Path) -> list[str]:
    return path.read_text().split() if path.is_file() else []


async def _devtools_address(active_port: Path) -> tuple[str, str]:
    """The port Chromium picked and its browser websocket path, from the file it writes once listening."""
    async with asyncio.timeout(WAIT_S):
        while True:
            lines = await asyncio.to_thread(_words_of, active_port)
            if len(lines) >= 2:
                return lines[0], lines[1]
            await asyncio.sleep(0.05)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def live(tiny_models: Path, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[LiveServer]:
    webrtc = WebRTCConfig(host_addresses=(LOOPBACK,))
    async with serve(service_config(tiny_models, tmp_path_factory.mktemp("voices"), webrtc=webrtc)) as server:
        yield server


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium package (make install-test)")
async def test_page_plays_speech_over_webrtc_and_websocket(live: LiveServer, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    received: list[LLMRequest] = []
    for engine in live.runtime._engines.llms:  # type: ignore[union-attr]

        def recording(request: LLMRequest, submit: Any = engine.submit) -> Any:
            received.append(request)
            return submit(request)

        monkeypatch.setattr(engine, "submit", recording)
    text = live.runtime._engines.text  # type: ignore[union-attr]
    instruction = "Speak softly, like a bedtime story."
    instruction_ids = (*text.encode(instruction), text.token_id("<|endofprompt|>"))

    async with chromium(f"{live.http_url}/", tmp_path / "profile") as page:
        await page.wait_for(
            "document.readyState === 'complete' && document.getElementById('voice')?.value === 'default'"
        )
        await page.evaluate(f"document.getElementById('instructions').value = {json.dumps(instruction)}")

        # WebRTC: the connection comes up, Opus packets arrive, the server reports first audio.
        await page.evaluate("document.getElementById('speak').click()")
        await page.wait_for("__rt.webrtc.connectionState === 'connected' && __rt.webrtc.packetsReceived > 0")
        await page.wait_for("__rt.lastLatencyMs !== null")
        await page.wait_for("__rt.level > 0")
        await page.evaluate("document.getElementById('stop').click()")
        await page.wait_for("__rt.events.includes('cancelled')")
        assert received[0].mode is PromptMode.INSTRUCT2
        assert tuple(received[0].prompt_text_ids) == instruction_ids

        # A voice uploaded through the page's form becomes the selected voice.
        clip = tmp_path / "clip.wav"
        await asyncio.to_thread(soundfile.write, clip, voiced_clip(seconds=3.0), SAMPLE_RATE)
        await page.choose_file("#upload-file", clip)
        await page.evaluate(
            "document.getElementById('upload-name').value = 'from-the-page';"
            "document.getElementById('upload-text').value = 'A voice uploaded from the page.';"
            "document.getElementById('upload-form').requestSubmit()"
        )
        await page.wait_for("document.getElementById('voice').value === 'from-the-page'")

        # Websocket, with that voice: PCM frames arrive and the AudioWorklet plays them.
        await page.evaluate("document.querySelector('input[value=ws]').click()")
        await page.evaluate("document.getElementById('speak').click()")
        await page.wait_for("__rt.ws.bytesReceived > 0 && __rt.ws.samplesPlayed > 0")
        await page.wait_for("__rt.lastLatencyMs !== null")
        assert received[-1].mode is PromptMode.INSTRUCT2
        assert tuple(received[-1].prompt_text_ids) == instruction_ids

        shot = await page.call("Page.captureScreenshot", {"format": "png"}, page=True)
        await asyncio.to_thread(SCREENSHOT.write_bytes, base64.b64decode(shot["data"]))
        await page.evaluate("document.getElementById('stop').click()")
        await page.wait_for("__rt.events.at(-1) === 'cancelled'")

        # The server sends faster than real time: once it is done, seconds of audio still play. Until
        # they have, the page is still speaking and Stop works; Stop then silences the player.
        long_text = " ".join(["This sentence is here to make the utterance last a good while."] * 6)
        await page.evaluate(f"document.getElementById('text').value = {json.dumps(long_text)}")
        await page.evaluate("document.getElementById('speak').click()")
        await page.wait_for("__rt.ws.serverDone && __rt.ws.buffered > 0")
        assert await page.evaluate("__rt.state") == "speaking"
        assert await page.evaluate("document.getElementById('stop').disabled") is False
        assert await page.evaluate("__rt.events.at(-1)") == "all audio received; playing the rest"
        await page.evaluate("document.getElementById('stop').click()")
        await page.wait_for("__rt.events.at(-1) === 'cancelled' && __rt.ws.samplesCleared > 0")
        await page.wait_for("__rt.ws.buffered === 0")
        played = await page.evaluate("__rt.ws.samplesPlayed")
        await asyncio.sleep(0.5)  # several of the player's progress reports
        assert await page.evaluate("__rt.ws.samplesPlayed") == played
        assert await page.evaluate("document.getElementById('stop').disabled") is True

        # Left to play out, an utterance is done only once its last sample has played.
        await page.evaluate("document.getElementById('text').value = 'Short one.'")
        await page.evaluate("document.getElementById('speak').click()")
        await page.wait_for("__rt.events.at(-1) === 'done'")
        ws_state = await page.evaluate("JSON.stringify(__rt.ws)")
        assert await page.evaluate(
            "__rt.ws.samplesPlayed + __rt.ws.samplesDropped + __rt.ws.samplesCleared >= __rt.ws.samplesPosted"
        ), ws_state

        # An error from the server ends the utterance on the page and says why.
        await page.evaluate(
            "document.getElementById('voice').add(new Option('nobody', 'nobody', true, true))"
        )
        await page.evaluate("document.getElementById('speak').click()")
        await page.wait_for(
            "__rt.state === 'error' && __rt.events.some((line) => line.startsWith('error voice_not_found'))"
        )
        await page.wait_for("!document.getElementById('speak').disabled")
        assert page.exceptions == [], page.exceptions
