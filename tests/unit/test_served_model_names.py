"""--served-model-name takes several names, as vLLM's does: a request may give
any of them, /v1/models lists each, answers report the first."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from heron.engine.args import EngineArgs, served_model_names
from heron.entrypoints.openai.errors import APIError
from heron.entrypoints.openai.routes import install_error_handlers, router
from heron.entrypoints.openai.serving_common import ServingContext, check_model_name


def context(*names: str) -> ServingContext:
    engine = SimpleNamespace(config=SimpleNamespace(model=SimpleNamespace(model="/models/smol")))
    return ServingContext(engine=engine, served_model_name=names[0],  # type: ignore[arg-type]
                          served_model_aliases=names[1:], max_model_len=64)


def test_the_flag_takes_several_names_and_the_first_is_reported():
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = EngineArgs.from_cli_args(parser.parse_args(["--served-model-name", "smol", "gpt-4o-mini"]))
    config = EngineArgs(device="cpu", served_model_name=args.served_model_name).create_engine_config()
    assert (config.model.served_model_name, config.model.served_model_aliases) == ("smol", ("gpt-4o-mini",))
    one = EngineArgs(device="cpu", served_model_name="smol").create_engine_config().model
    assert (one.served_model_name, one.served_model_aliases) == ("smol", ())
    default = EngineArgs(device="cpu").create_engine_config().model
    assert default.served_model_name == "SmolLM2-135M-Instruct" and default.served_model_aliases == ()


@pytest.mark.parametrize(("value", "error", "fragment"), [
    ("", ValueError, "empty string"),
    (["a", ""], ValueError, "empty string"),
    ([], ValueError, "empty list"),
    (["a", "b", "a"], ValueError, r"\['a'\] more than once"),
    (7, TypeError, "int 7"),
    (["a", 7], TypeError, "int 7"),
])
def test_bad_names_are_refused_naming_the_option(value, error, fragment):
    with pytest.raises(error, match=fragment) as info:
        served_model_names(value)
    assert "served_model_name" in str(info.value)
    with pytest.raises(error, match=fragment):
        EngineArgs(device="cpu", served_model_name=value).create_engine_config()


def test_a_request_may_name_any_of_the_names():
    ctx = context("smol", "gpt-4o-mini")
    for name in ("smol", "gpt-4o-mini", None):
        check_model_name(ctx, name)
    with pytest.raises(APIError) as info:
        check_model_name(ctx, "gpt-9")
    assert info.value.status_code == 404


def test_models_lists_every_name_and_retrieves_each():
    app = FastAPI()
    app.state.serving = context("smol", "gpt-4o-mini")
    app.state.created = 1
    install_error_handlers(app)
    app.include_router(router)
    client = TestClient(app)
    listed = client.get("/v1/models").json()["data"]
    assert [card["id"] for card in listed] == ["smol", "gpt-4o-mini"]
    assert {card["root"] for card in listed} == {"/models/smol"}
    assert client.get("/v1/models/gpt-4o-mini").json()["id"] == "gpt-4o-mini"
    missing = client.get("/v1/models/gpt-9")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
