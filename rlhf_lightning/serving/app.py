"""The reward server's HTTP face (FastAPI): ``GET /info`` and ``POST /score``; a bad request is a 422 with one
line ``{"error": ...}``, never a 500 with a traceback (an error of the server itself is a 500 with one line, and its
traceback goes to the server's log)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from rlhf_lightning.cli.errors import error_message, user_error
from rlhf_lightning.rewards.remote_protocol import encode_score
from rlhf_lightning.serving.batching import Batcher
from rlhf_lightning.serving.scoring import RewardService

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


def validation_line(error: RequestValidationError) -> str:
    """pydantic's list of problems as one line: the first, where it is, how many more, what was expected."""
    problems = error.errors()
    first = problems[0] if problems else {"loc": (), "msg": "invalid request"}
    where = ".".join(str(part) for part in first.get("loc", ())[1:]) or "body"
    if first.get("type") == "json_invalid":
        where = "body"
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    return f"{where}: {first.get('msg')}{more}; expected {SCORE_SCHEMA}"


def make_app(service: RewardService, max_batch_size: int, max_wait: float) -> FastAPI:
    """The FastAPI application serving ``service``, batching concurrent requests (:class:`Batcher`)."""
    batcher = Batcher(service, max_batch_size, max_wait)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        worker = asyncio.create_task(batcher.run())
        yield
        worker.cancel()

    app = FastAPI(title="rlhf_lightning reward server", lifespan=lifespan)

    @app.exception_handler(RequestValidationError)
    async def refuse(request: Request, error: RequestValidationError) -> JSONResponse:
        return JSONResponse({"error": validation_line(error)}, status_code=422)

    @app.exception_handler(Exception)
    async def fail(request: Request, error: Exception) -> JSONResponse:
        # The traceback goes to the server's log (Starlette re-raises it to uvicorn); the client reads one line.
        return JSONResponse({"error": f"the reward server failed: {type(error).__name__}: {error} (its "
                                      "traceback is in the server's log)"}, status_code=500)

    @app.get("/info")
    async def info() -> dict[str, Any]:
        return service.info(max_batch_size)

    @app.post("/score", response_model=None)
    async def score(request: ScoreRequest) -> dict[str, Any] | JSONResponse:
        try:
            rows = service.rows(request.prompts, request.completions, request.completion_ids, request.input_ids,
                                request.columns, request.attention_mask)
            scores = await batcher.score(rows) if len(rows) else []
        except Exception as error:
            ours = user_error(error)  # a bad row, or a source's refusal (FunctionReward naming a NaN's row)
            if ours is None:
                raise
            return JSONResponse({"error": error_message(ours)}, status_code=422)
        return {"scores": [encode_score(value) for value in scores]}

    return app
