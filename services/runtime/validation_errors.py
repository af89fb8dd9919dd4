"""A request body that fails validation answers 422 with where and why, never the input itself: FastAPI's
default echoes the offending value back (`input`, and the model's context), which can be large, can carry a
secret the client sent by mistake, and hands an attacker a reflection of whatever they posted."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

MAX_ERRORS = 20  # a body with a million bad items needs only the first few named


def validation_detail(exc: RequestValidationError) -> list[dict]:
    return [
        {"loc": list(e.get("loc", ())), "msg": e.get("msg", ""), "type": e.get("type", "")}
        for e in exc.errors()[:MAX_ERRORS]
    ]


def answer_validation_errors_without_input(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def invalid(_, exc: RequestValidationError):
        return JSONResponse({"detail": validation_detail(exc)}, status_code=422)
