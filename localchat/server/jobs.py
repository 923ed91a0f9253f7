"""What every endpoint shares: the one-line request log, OpenAI's error object, and a
job's events read as they come (a client that has gone cancels its job)."""
from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse

from .requests import ApiError
from .runner import Job


def error_response(exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def log(status: int, path: str, t0: float, stats=None, note: str = "") -> None:
    line = f"localchat serve: {status} {path} {time.monotonic() - t0:.2f}s"
    if stats is not None:
        line += (f" · {stats.prompt_tokens} prompt ({stats.prefill_tokens} prefilled) + {stats.generated_tokens} tokens"
                 f" · prefill {stats.prefill_tps:.0f} tok/s · decode {stats.decode_tps:.1f} tok/s")
    print(line + (f" · {note}" if note else ""), file=sys.stderr, flush=True)


async def next_event(job: Job, request: Request):
    """The job's next event; cancels the job when the client has gone."""
    while True:
        try:
            return await asyncio.wait_for(job.events.get(), 0.25)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                job.cancelled.set()


def openai_calls(calls) -> list[dict]:
    """The engine's calls in OpenAI's shape: an id each, the arguments as a JSON string."""
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)}}
            for c in calls]


async def first_event(job, request, t0, shape=error_response):
    """The job's first event, and the response refusing the request if that is an error
    (in the API's error shape). Headers wait for it: a request refused in the queue (or a
    conversation the context cannot hold) still gets its status, not a 200 stream."""
    try:
        first = await next_event(job, request)
    except asyncio.CancelledError:
        job.cancelled.set()
        raise
    if first[0] == "error":
        log(first[1].status, request.url.path, t0, note=first[1].message)
        return first, shape(first[1])
    return first, None
