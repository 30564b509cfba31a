"""The elastic API's request and response models, and its OpenAPI document generated from them.

The document was a 172-line hand-written dict beside the code that validated the same fields, free to
drift from it. Here each body is a pydantic model: its JSON Schema is the document's, and the field names
the service accepts are the models' (``SCALE_OUT_FIELDS`` / ``SCALE_IN_FIELDS``). Validation itself stays
in :mod:`relax_rollout.elastic_service`, which answers each mistake with a message naming the field and
what to do (the models describe; they do not produce the 400s). OpenAPI 3.1, whose schemas are JSON
Schema 2020-12, what pydantic writes.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field

OpState = Literal["pending", "running", "succeeded", "failed", "cancelled"]
EngineKind = Literal["startup", "ray_native", "external"]
OP_STATES: tuple[str, ...] = get_args(OpState)
ENGINE_KINDS: tuple[str, ...] = get_args(EngineKind)

RequestId = Annotated[
    str,
    Field(
        min_length=1,
        max_length=200,
        description="Idempotency key: the same id returns the same operation (200).",
    ),
]
EngineUrl = Annotated[str, Field(pattern=r"^https?://", json_schema_extra={"format": "uri"})]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ScaleOutRequest(_Request):
    """Exactly one of num_replicas or engine_urls."""

    num_replicas: int | None = Field(
        None, ge=1, description="Target number of active engines; new ones are launched on Ray."
    )
    engine_urls: list[EngineUrl] | None = Field(
        None, min_length=1, description="Running SGLang-compatible servers to join."
    )
    node: str | None = Field(
        None,
        min_length=1,
        description="With num_replicas: the Ray node (its address) to launch the new engines on; needs "
        "engines bound to their node's address (--elastic-host node). Default: the rollout's node.",
    )
    request_id: RequestId | None = None


class ScaleInRequest(_Request):
    """Exactly one of num_replicas, engine_ids or engine_urls."""

    num_replicas: int | None = Field(
        None, ge=1, description="Target number of active engines (newest non-protected removed first)."
    )
    engine_ids: list[str] | None = Field(
        None, min_length=1, description="Engines to remove (never protected start-up ones)."
    )
    engine_urls: list[EngineUrl] | None = Field(None, min_length=1, description="Engines to remove, by URL.")
    drain_timeout_s: float | None = Field(None, ge=0, description="How long in-flight requests may finish.")
    force: bool = Field(
        True, description="After the drain time-out, abort in-flight requests (re-issued elsewhere)."
    )
    request_id: RequestId | None = None


SCALE_OUT_FIELDS = tuple(ScaleOutRequest.model_fields)
SCALE_IN_FIELDS = tuple(ScaleInRequest.model_fields)


class Operation(BaseModel):
    """A scaling operation (``Operation.to_dict`` in :mod:`relax_rollout.elastic_service`)."""

    id: str
    kind: Literal["scale_out", "scale_in"]
    request: dict[str, Any]
    request_id: str | None
    state: OpState
    engines_added: list[str]
    engines_removed: list[str]
    targets: list[str] = Field(description="Scale-in: the engines chosen when the request was accepted.")
    rollback: list[str] = Field(
        description="What a cancel (or a failed scale-out) undid, one line per engine."
    )
    error: str | None
    cancel_requested: bool
    created: float
    started: float | None
    finished: float | None


class OperationList(BaseModel):
    object: Literal["list"]
    data: list[Operation]


class Engine(BaseModel):
    """One engine of the pool (``EnginePool.members``)."""

    id: str
    url: str
    kind: EngineKind
    state: Literal["joining", "active", "draining", "removed", "failed"]
    protected: bool
    inflight: int
    weight_version: int | None
    created: float
    served: int
    error: str | None
    replaced_by: str | None
    node: str | None = Field(description="The node address a scale-out launched it on (null: the default).")


class EngineList(BaseModel):
    object: Literal["list"]
    data: list[Engine]
    active: int
    weight_version: int
    stats: dict[str, Any] = Field(description="The pool's counters (EnginePool.stats).")


class Error(BaseModel):
    """SGLang's error shape."""

    object: Literal["error"]
    message: str
    type: str
    param: str | None = Field(None, description="The offending field (400).")
    code: int
    operation: str | None = Field(None, description="The conflicting operation (409).")


MODELS = (ScaleOutRequest, ScaleInRequest, Operation, OperationList, Engine, EngineList, Error)


def _json(schema: str | dict, description: str) -> dict:
    ref = {"$ref": f"#/components/schemas/{schema}"} if isinstance(schema, str) else schema
    return {"description": description, "content": {"application/json": {"schema": ref}}}


def _schemas() -> dict[str, dict]:
    out: dict[str, dict] = {}
    for model in MODELS:
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        out.update(schema.pop("$defs", {}))
        out[model.__name__] = schema
    return out


def openapi() -> dict:
    """The API as an OpenAPI 3.1 document (``GET /elastic/openapi.json``)."""
    unauth = _json("Error", "Missing or wrong bearer token (only when the API has a token).")
    paths = {**_scale_paths(unauth), **_operation_paths(unauth), **_read_paths(unauth)}
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "Relax elastic rollout API",
            "version": "1",
            "description": "Scale the rollout engine pool of a running Relax job. Asynchronous operations, one "
            "at a time; unknown routes answer 404.",
        },
        "paths": paths,
        "components": {
            "schemas": _schemas(),
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}],
    }


def _scale_paths(unauth: dict) -> dict:
    """The two calls that change the pool."""
    scale = {
        "200": _json("Operation", "Known request_id: the operation it started."),
        "202": _json("Operation", "Accepted: the operation started (poll GET /elastic/operations/{id})."),
        "400": _json("Error", "Invalid body (param names the field) or a request the pool cannot honour."),
        "401": unauth,
        "409": _json(
            "Error",
            "Another operation is pending or running, or the request_id was used for another request.",
        ),
    }

    def body(model: type[BaseModel]) -> dict:
        return {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}},
        }

    return {
        "/elastic/scale_out": {
            "post": {
                "summary": "Add engines (launched on Ray, or running servers by URL)",
                "operationId": "scaleOut",
                "requestBody": body(ScaleOutRequest),
                "responses": scale,
            }
        },
        "/elastic/scale_in": {
            "post": {
                "summary": "Drain and remove engines",
                "operationId": "scaleIn",
                "requestBody": body(ScaleInRequest),
                "responses": scale,
            }
        },
    }


def _operation_paths(unauth: dict) -> dict:
    """The operations the scaling calls started: list, read, cancel."""
    op_id = [
        {
            "name": "id",
            "in": "path",
            "required": True,
            "schema": {"type": "string"},
            "description": "Operation id.",
        }
    ]
    return {
        "/elastic/operations": {
            "get": {
                "summary": "Every operation, oldest first",
                "operationId": "listOperations",
                "responses": {"200": _json("OperationList", "The operations."), "401": unauth},
            }
        },
        "/elastic/operations/{id}": {
            "get": {
                "summary": "One operation's status",
                "operationId": "getOperation",
                "parameters": op_id,
                "responses": {
                    "200": _json("Operation", "The operation."),
                    "401": unauth,
                    "404": _json("Error", "Unknown operation id."),
                },
            }
        },
        "/elastic/operations/{id}/cancel": {
            "post": {
                "summary": "Cancel an operation and roll it back",
                "operationId": "cancelOperation",
                "parameters": op_id,
                "responses": {
                    "200": _json("Operation", "Cancelled and rolled back."),
                    "202": _json("Operation", "Cancel requested; the rollback is still running."),
                    "401": unauth,
                    "404": _json("Error", "Unknown operation id."),
                    "409": _json("Error", "The operation is already finished."),
                },
            }
        },
    }


def _read_paths(unauth: dict) -> dict:
    """What can be read: the engines, the metrics, this document."""
    return {
        "/elastic/engines": {
            "get": {
                "summary": "The pool's engines",
                "operationId": "listEngines",
                "parameters": [
                    {
                        "name": "include_removed",
                        "in": "query",
                        "required": False,
                        "schema": {"type": "boolean"},
                        "description": "Also list removed engines.",
                    }
                ],
                "responses": {
                    "200": _json("EngineList", "The engines and the pool's counters."),
                    "401": unauth,
                },
            }
        },
        "/elastic/metrics": {
            "get": {
                "summary": "Prometheus metrics of the pool and its operations",
                "operationId": "metrics",
                "responses": {
                    "200": {
                        "description": "Prometheus text format 0.0.4.",
                        "content": {"text/plain": {"schema": {"type": "string"}}},
                    },
                    "401": unauth,
                },
            }
        },
        "/elastic/openapi.json": {
            "get": {
                "summary": "This document",
                "operationId": "openapi",
                "responses": {"200": _json({"type": "object"}, "The OpenAPI 3.1 document."), "401": unauth},
            }
        },
    }
