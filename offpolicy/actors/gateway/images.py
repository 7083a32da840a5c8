"""Images in gateway calls: OpenAI `image_url` content parts, read and checked before anything is recorded.

An agent that reads screenshots sends them as OpenAI content parts, `{"type": "image_url", "image_url":
{"url": ...}}`, in its episode's first call (the episode's prompt):

- a `data:image/<type>;base64,...` URL is decoded;
- an `http(s)://` URL is refused unless `gateway.remote_image_timeout_s` is set: then it is fetched once,
  within that many seconds and at most `gateway.vision.max_image_bytes` bytes (a larger body is refused
  as soon as it passes the limit, without reading the rest); redirects are not followed;
- any other scheme is refused.

Each image is then checked as a dataset's are (actors/data/images.py: size, format, Pillow decodes it
whole) against `gateway.vision`; a refusal is a `ChatRequestError` naming the part
(`messages[i].content[j].image_url`), and the call changes nothing. What the episode records is what the
model saw: the encoded bytes (stored once in the buffer by sha256 with the group) and the prompt with each
image's placeholder widened to its tokens, as the engine ran it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from offpolicy.actors.data.images import ImageRefused, PromptImage, check_image, decode_data_url
from offpolicy.actors.engine.chat import image_parts
from offpolicy.actors.errors import ChatRequestError

if TYPE_CHECKING:
    from offpolicy.actors.config import GatewayConfig


async def read_call_images(
    messages: Sequence[Mapping[str, Any]], config: GatewayConfig
) -> tuple[PromptImage, ...]:
    """The images of a call's `messages`, in order, each read and checked (see the module docstring)."""
    parts = image_parts(messages)
    if len(parts) > config.vision.max_images:
        raise ChatRequestError(
            parts[config.vision.max_images][0],
            f"{len(parts)} images > gateway.vision.max_images={config.vision.max_images}",
        )
    images = []
    for field, url in parts:
        data = await _fetch(field, url, config)
        try:
            images.append(check_image(data, "gateway", 0, config.vision))
        except ImageRefused as e:
            raise ChatRequestError(field, e.reason.replace("dataset.vision", "gateway.vision")) from e
    return tuple(images)


async def _fetch(field: str, url: str, config: GatewayConfig) -> bytes:
    if url.startswith("data:"):
        try:
            return decode_data_url(url)
        except ValueError as e:
            raise ChatRequestError(field, str(e)) from e
    if not url.startswith(("http://", "https://")):
        raise ChatRequestError(field, f"unsupported URL scheme ({url[:40]!r}): a data: URL or http(s)")
    timeout = config.remote_image_timeout_s
    if timeout is None:
        raise ChatRequestError(
            field,
            "remote image URLs are refused (gateway.remote_image_timeout_s is null): send the image as a "
            "data: URL (data:image/png;base64,...)",
        )
    return await _download(field, url, timeout, config.vision.max_image_bytes)


async def _download(field: str, url: str, timeout_s: float, max_bytes: int) -> bytes:
    """GET `url` within `timeout_s` (the whole download), at most `max_bytes` read."""
    import asyncio

    import httpx

    async def get() -> bytes:
        async with (
            httpx.AsyncClient(follow_redirects=False, timeout=timeout_s) as client,
            client.stream("GET", url) as response,
        ):
            if response.status_code != 200:
                raise ChatRequestError(field, f"{url[:80]} answered {response.status_code}")
            body = bytearray()
            async for chunk in response.aiter_bytes():
                body += chunk
                if len(body) > max_bytes:
                    raise ChatRequestError(
                        field, f"{url[:80]} is over gateway.vision.max_image_bytes={max_bytes}"
                    )
            return bytes(body)

    try:
        async with asyncio.timeout(timeout_s):
            return await get()
    except TimeoutError as e:
        raise ChatRequestError(
            field, f"{url[:80]} did not arrive within gateway.remote_image_timeout_s={timeout_s}"
        ) from e
    except httpx.HTTPError as e:
        raise ChatRequestError(field, f"{url[:80]}: {type(e).__name__}: {e}") from e
