"""The web page in real headless Chromium against a server that requires API keys, opened as
`/?api_key=KEY`: it speaks over WebRTC (Bearer on signalling) and the websocket (`api_key` parameter),
and lists voices; the same page without a key is refused."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from test_browser import CHROMIUM, LOOPBACK, chromium
from testing import LiveServer, serve, service_config

from realtime.config import AccessConfig, WebRTCConfig

pytestmark = [pytest.mark.browser, pytest.mark.asyncio(loop_scope="session")]

KEY = "page-key-2468"


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def keyed(tiny_models: Path, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[LiveServer]:
    config = service_config(
        tiny_models,
        tmp_path_factory.mktemp("voices"),
        webrtc=WebRTCConfig(host_addresses=(LOOPBACK,)),
        access=AccessConfig(api_keys=(KEY,)),
    )
    async with serve(config) as server:
        yield server


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium package (make install-test)")
async def test_page_with_a_key_speaks_over_both_transports(keyed: LiveServer, tmp_path: Path) -> None:
    async with chromium(f"{keyed.http_url}/?api_key={KEY}", tmp_path / "profile") as page:
        await page.wait_for(
            "document.readyState === 'complete' && document.getElementById('voice')?.value === 'default'"
        )
        await page.evaluate("document.getElementById('speak').click()")
        await page.wait_for("__rt.webrtc.connectionState === 'connected' && __rt.webrtc.packetsReceived > 0")
        await page.evaluate("document.getElementById('stop').click()")
        await page.wait_for("__rt.events.includes('cancelled')")
        await page.evaluate("document.querySelector('input[value=ws]').click()")
        await page.evaluate("document.getElementById('speak').click()")
        await page.wait_for("__rt.ws.bytesReceived > 0")
        assert not page.exceptions, page.exceptions


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium package (make install-test)")
async def test_page_without_a_key_is_refused(keyed: LiveServer, tmp_path: Path) -> None:
    async with chromium(f"{keyed.http_url}/", tmp_path / "profile") as page:
        await page.wait_for("document.readyState === 'complete'")
        await page.evaluate("document.getElementById('speak').click()")
        await page.wait_for("__rt.state === 'error' || __rt.events.includes('error')")
