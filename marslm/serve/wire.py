"""What both servers write on the wire by hand: the OpenAI error object, and a whole JSON response
sent straight through ASGI (where no framework is left to send it: the outermost guard, the vLLM
middleware). Standard library only, so the vLLM plugin's process imports it too."""

from __future__ import annotations

import json


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


async def send_json(send, status: int, body: dict) -> None:
    data = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": data, "more_body": False})
