"""What crosses between `RayEngine` and an engine actor, without Ray: the actor side
(`EngineActorMixin`) runs real handle operations on a real in-process replica and
answers JSON; the trainer side turns answers back into enginehooks' own errors. Ray
itself runs for real in tests/vllm/test_ray.py."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from enginehooks import ConfigError, ManifestError, ReplicaError
from enginehooks.core.manifest import plan
from enginehooks.engine.local import LocalEngine
from enginehooks.ray_ext import EngineActorMixin
from enginehooks.ray_ext.calls import raise_reply
from enginehooks.trainer_side import adapter_for


class ModuleActor(EngineActorMixin):
    """What an actor class holding a torch module as its engine looks like."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.handle = LocalEngine(nn.Linear(4, 2), name="actor-engine")

    def enginehooks_handle(self) -> LocalEngine:
        return self.handle


def test_actor_side_answers_json_and_errors_by_name() -> None:
    actor = ModuleActor()
    info = actor.enginehooks_call("info", [], 10.0)
    assert json.loads(json.dumps(info)) == info and info["result"][0]["state"] == "initial"
    bad = plan(adapter_for({"weight": torch.zeros(3, 4)}).specs(), weight_version=1,
               bucket_bytes=1 << 20)
    reply = actor.enginehooks_call("check", [bad.to_json()], 10.0)
    assert reply["error"] == "ManifestError" and "weight" in reply["message"]
    assert actor.enginehooks_call("reboot", [], 10.0)["error"] == "ConfigError"
    assert actor.enginehooks_call("engine_version", [], 10.0)["error"] == "ConfigError"


def test_trainer_side_restores_enginehooks_errors() -> None:
    assert raise_reply({"result": [1]}, "a", "info") == [1]
    with pytest.raises(ManifestError, match="refused") as err:
        raise_reply({"error": "ManifestError", "message": "refused"}, "rollout-0", "check")
    assert err.value.replica == "rollout-0"
    with pytest.raises(ConfigError):
        raise_reply({"error": "ConfigError", "message": "x"}, "a", "reboot")
    with pytest.raises(ReplicaError, match=r"'rollout-0'.*receive failed in the actor: "
                                           r"RuntimeError: boom"):
        raise_reply({"error": "RuntimeError", "message": "boom"}, "rollout-0", "receive")
    with pytest.raises(ReplicaError, match="answered"):
        raise_reply("garbage", "a", "info")
