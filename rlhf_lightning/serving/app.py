"""The reward server's HTTP face (FastAPI): ``GET /info`` and ``POST /score``, behind its guard (token, body and
load limits: :mod:`~rlhf_lightning.serving.guard`). A client's mistake is a 4xx with one line ``{"error": ...}``; an
error of the server itself is a 500 whose line holds no internals (an id; the traceback, under that id, goes to the
server's log). A request's body is decoded, checked and tokenized on a worker thread: a large or slow request never
holds the event loop, so other clients' requests go on being taken.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, ValidationError

from rlhf_lightning.cli.errors import error_message, user_error
from rlhf_lightning.rewards.remote_protocol import encode_score
from rlhf_lightning.serving.batching import Batcher
from rlhf_lightning.serving.guard import DEFAULT_LIMITS, BodyTooLarge, Guard, Limits
from rlhf_lightning.serving.scoring import RequestError, RewardService

log = logging.getLogger(__name__)
SCORE_SCHEMA = ('{"prompts": [text or messages], "completions": [text], "completion_ids": [[int]] (optional), '
                '"input_ids": [[int]] (optional), "attention_mask": [[0 or 1]] (optional), "columns": {name: [value]} '
                '(optional)}')


class ScoreRequest(BaseModel):
    """``POST /score``: one entry per completion in every list."""

    model_config = ConfigDict(extra="forbid")

    prompts: list[str | list[dict[str, Any]]]  # as the dataset holds them: text, or a list of messages
    completions: list[str]  # the responses as text
    completion_ids: list[list[int]] | None = None  # the response tokens; null: the completion's own tokens
    input_ids: list[list[int]] | None = None  # prompt + response + end token as scored; null: encoded here
    attention_mask: list[list[int]] | None = None  # with input_ids as padded rows of one width: the client's layout
    columns: dict[str, list[Any]] = {}  # the dataset's other columns (for reward functions)


def validation_line(error: ValidationError) -> str:
    """pydantic's list of problems as one line: the first, where it is, how many more, what was expected."""
    problems = error.errors()
    first = problems[0] if problems else {"loc": (), "msg": "invalid request"}
    where = ".".join(str(part) for part in first.get("loc", ())) or "body"
    if first.get("type") == "json_invalid":
        where = "body"
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    return f"{where}: {first.get('msg')}{more}; expected {SCORE_SCHEMA}"


def parse(body: bytes, max_rows: int) -> ScoreRequest:
    """A ``POST /score`` body as a :class:`ScoreRequest`; :class:`RequestError` (a 422) for anything else, and for
    more than ``max_rows`` completions."""
    try:
        request = ScoreRequest.model_validate_json(body)
    except ValidationError as error:
        raise RequestError(validation_line(error)) from None
    if len(request.completions) > max_rows:
        raise RequestError(f"completions has {len(request.completions)} entries, beyond the server's max_rows "
                           f"{max_rows}: send fewer per request (RemoteReward's batch_size)")
    return request


def make_app(service: RewardService, max_batch_size: int, max_wait: float, limits: Limits = DEFAULT_LIMITS,
             docs: bool = False) -> Guard:
    """The application serving ``service`` behind its :class:`Guard`, batching concurrent requests
    (:class:`Batcher`); FastAPI's ``/docs``, ``/redoc`` and ``/openapi.json`` only with ``docs``."""
    batcher = Batcher(service, max_batch_size, max_wait)
    # One thread decodes and tokenizes the requests, in turn: off the event loop, and one at a time because a
    # fast tokenizer is not safe to share between threads.
    preparing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reward-server-requests")

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        worker = asyncio.create_task(batcher.run())
        yield
        worker.cancel()
        preparing.shutdown(wait=False, cancel_futures=True)

    pages = {} if docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="rlhf_lightning reward server", lifespan=lifespan, **pages)

    @app.exception_handler(BodyTooLarge)
    async def too_large(request: Request, error: BodyTooLarge) -> JSONResponse:
        return JSONResponse({"error": str(error)}, status_code=413)

    @app.exception_handler(Exception)
    async def fail(request: Request, error: Exception) -> JSONResponse:
        # The client reads an id and no internals (paths, library messages); the traceback, under that id, goes to
        # the server's log (Starlette re-raises the error to uvicorn after this answer).
        incident = uuid.uuid4().hex[:8]
        log.error("reward server error %s on %s %s: %s: %s", incident, request.method, request.url.path,
                  type(error).__name__, error)
        return JSONResponse({"error": f"the reward server failed on this request (error {incident}: its traceback "
                                      "is in the server's log)"}, status_code=500)

    @app.get("/info")
    async def info() -> dict[str, Any]:
        return service.info(max_batch_size)

    def prepare(body: bytes) -> Any:
        request = parse(body, limits.max_rows)
        return service.rows(request.prompts, request.completions, request.completion_ids, request.input_ids,
                            request.columns, request.attention_mask)

    @app.post("/score", response_model=None)
    async def score(request: Request) -> dict[str, Any] | JSONResponse:
        body = await request.body()  # counted by the guard as it arrives
        try:
            rows = await asyncio.get_running_loop().run_in_executor(preparing, prepare, body)
            scores = await batcher.score(rows) if len(rows) else []
        except Exception as error:
            ours = user_error(error)  # a bad row, or a source's refusal (FunctionReward naming a NaN's row)
            if ours is None:
                raise
            return JSONResponse({"error": error_message(ours)}, status_code=422)
        return {"scores": [encode_score(value) for value in scores]}

    return Guard(app, limits)
