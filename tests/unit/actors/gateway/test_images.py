"""A gateway call's images (gateway/images.py) against a real local HTTP server: data: URLs decoded, remote
URLs refused unless allowed, then fetched within their time and size limits (redirects not followed);
each refusal names the content part."""

from __future__ import annotations

import asyncio
import base64
import http.server
import threading
import time
from collections.abc import Iterator

import pytest

from offpolicy.actors.config import GatewayConfig
from offpolicy.actors.data.toy import square_png
from offpolicy.actors.errors import ChatRequestError
from offpolicy.actors.gateway.images import read_call_images

PNG = square_png((200, 30, 30), 28, 28)


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path == "/redirect":
            self.send_response(302)
            self.send_header("Location", "/ok.png")
            self.end_headers()
            return
        body = {"/ok.png": PNG, "/big.png": PNG + b"\0" * 5000, "/slow.png": PNG}.get(self.path)
        if body is None:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.path == "/slow.png":
            time.sleep(3)
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def call(*urls: str) -> list[dict]:
    parts = [{"type": "text", "text": "look"}] + [
        {"type": "image_url", "image_url": {"url": u}} for u in urls
    ]
    return [{"role": "system", "content": "s"}, {"role": "user", "content": parts}]


def refusal(messages: list[dict], config: GatewayConfig) -> ChatRequestError:
    with pytest.raises(ChatRequestError) as e:
        asyncio.run(read_call_images(messages, config))
    return e.value


def test_data_urls_are_read_and_remote_ones_refused_unless_allowed(server: str) -> None:
    data = "data:image/png;base64," + base64.b64encode(PNG).decode()
    (image,) = asyncio.run(read_call_images(call(data), GatewayConfig()))
    assert image.data == PNG and (image.format, image.width) == ("PNG", 28)
    e = refusal(call(data, f"{server}/ok.png"), GatewayConfig())
    assert e.field == "messages[1].content[2].image_url" and "remote image URLs are refused" in str(e)
    assert "scheme" in str(refusal(call("file:///etc/passwd"), GatewayConfig()))
    assert "base64" in str(refusal(call("data:image/png,abc"), GatewayConfig()))
    assert "Pillow" in str(
        refusal(call("data:image/png;base64," + base64.b64encode(b"nope").decode()), GatewayConfig())
    )
    many = GatewayConfig(vision={"max_images": 1})
    assert refusal(call(data, data), many).field == "messages[1].content[2].image_url"
    with pytest.raises(ChatRequestError, match=r"image_url\.url"):
        asyncio.run(read_call_images([{"role": "user", "content": [{"type": "image_url"}]}], GatewayConfig()))


def test_allowed_remote_urls_are_fetched_within_their_time_and_size(server: str) -> None:
    allowed = GatewayConfig(remote_image_timeout_s=1.0, vision={"max_image_bytes": 4000})
    (image,) = asyncio.run(read_call_images(call(f"{server}/ok.png"), allowed))
    assert image.data == PNG
    assert "max_image_bytes" in str(refusal(call(f"{server}/big.png"), allowed))
    t0 = time.monotonic()
    assert "within gateway.remote_image_timeout_s" in str(refusal(call(f"{server}/slow.png"), allowed))
    assert time.monotonic() - t0 < 2.5
    assert "answered 302" in str(refusal(call(f"{server}/redirect"), allowed))  # not followed
    assert "answered 404" in str(refusal(call(f"{server}/none.png"), allowed))
