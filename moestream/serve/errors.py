"""Request errors, answered in the shape of the API the client speaks (see `app.py`)."""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    """A request the server refuses: HTTP status, one-sentence message, the field at fault."""

    def __init__(self, status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers or {}

    @property
    def openai_type(self) -> str:
        return {401: "authentication_error", 404: "not_found_error", 413: "invalid_request_error",
                429: "rate_limit_error", 503: "server_error"}.get(self.status, "invalid_request_error"
                                                                   if self.status < 500 else "server_error")

    @property
    def anthropic_type(self) -> str:
        return {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}.get(
                    self.status, "invalid_request_error" if self.status < 500 else "api_error")

    def openai_body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.openai_type, "param": self.param,
                          "code": None}}

    def anthropic_body(self) -> dict[str, Any]:
        return {"type": "error", "error": {"type": self.anthropic_type, "message": self.message}}


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param)


# ---- small typed readers of a JSON body: a wrong type is a 400 naming the field -----------------

def get(body: dict, name: str, kinds: type | tuple[type, ...], default: Any = None, *, required: bool = False) -> Any:
    if name not in body or body[name] is None:
        if required:
            raise bad_request(f"'{name}' is required.", name)
        return default
    value = body[name]
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    if isinstance(value, bool) and bool not in kinds:
        ok = False
    elif float in kinds and isinstance(value, int):
        ok = True
    else:
        ok = isinstance(value, kinds)
    if not ok:
        names = " or ".join({str: "a string", int: "an integer", float: "a number", bool: "a boolean",
                             list: "an array", dict: "an object"}[k] for k in kinds)
        raise bad_request(f"'{name}' must be {names}, got {type(value).__name__}.", name)
    return value
